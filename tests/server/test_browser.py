"""The `k3 serve` chat page (`/`) in headless Chromium (Debian's chromium + chromium-driver, driven by
selenium from tests/server/requirements.txt): a message is sent, its reply streams in (the text grows
while the request runs), the reply can be stopped with the Stop button, the page keeps working after
that, and the usage line shows the server's counts. K3_SCREENSHOT=PATH saves a screenshot there
(scripts/server_screenshot.sh writes docs/server-page.png).

Exit 77 (skipped, with a message) when selenium, chromium or chromedriver is missing.
"""
import json
import os
import shutil
import sys
import time
import unittest

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
except ImportError:
    print("SKIPPED: selenium is not installed (bash scripts/test.sh makes build/servevenv)")
    sys.exit(77)

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
if not CHROMIUM or not CHROMEDRIVER:
    print("SKIPPED: no chromium / chromedriver on PATH (Debian packages chromium, chromium-driver; "
          "scripts/test.sh installs them)")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_e2e import Server  # noqa: E402  (the same launcher as the API tests)


def wait_for(cond, timeout, what):
    end = time.time() + timeout
    while time.time() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError("timed out waiting for " + what)


def never_end_bias():
    """logit_bias that keeps the bundled model from closing its message: -100 on <|close|> and
    <|end_of_msg|>, ids read from the model's tokenizer_config.json."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    with open(os.path.join(root, "models", "k3-nano", "tokenizer_config.json"), encoding="utf-8") as f:
        added = json.load(f)["added_tokens_decoder"]
    ids = {v["content"]: k for k, v in added.items()}
    return {ids["<|close|>"]: -100, ids["<|end_of_msg|>"]: -100}


class ChatPage(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server()
        opts = webdriver.ChromeOptions()
        opts.binary_location = CHROMIUM
        for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--window-size=1100,800"):
            opts.add_argument(a)
        cls.driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
        cls.driver.set_page_load_timeout(60)

    @classmethod
    def tearDownClass(cls):
        cls.driver.quit()
        cls.server.stop()

    def assistant_boxes(self):
        return self.driver.find_elements(By.CSS_SELECTOR, "#log .msg.assistant")

    def send(self, text, max_tokens):
        d = self.driver
        mt = d.find_element(By.ID, "maxtok")
        mt.clear()
        mt.send_keys(str(max_tokens))
        box = d.find_element(By.ID, "input")
        box.send_keys(text)
        box.send_keys(Keys.ENTER)

    def reply_text(self, box):
        # reasoning (in the collapsible section) + answer, as the page shows them
        return box.get_attribute("textContent")

    def test_page(self):
        d = self.driver
        d.get(self.server.url + "/")
        wait_for(lambda: "k3-nano" in d.find_element(By.ID, "model").text, 30, "the model name from /v1/models")

        # 1. A long reply streams: the text grows in several steps while the request runs; then Stop.
        # The chat-tuned model ends a reply within ~100 tokens, which can beat the Stop click, so this
        # one request also tells the server never to pick <|close|> or <|end_of_msg|> (logit_bias,
        # ids from the model's tokenizer_config.json), added to the page's request body by a wrapper
        # around fetch; the page itself is unchanged.
        d.execute_script("""
            const bias = arguments[0];
            const f = window.fetch;
            window.fetch = (url, opts) => {
              if (window.k3TestLongReply && opts && opts.body && String(url).endsWith("/v1/chat/completions")) {
                const b = JSON.parse(opts.body); b.logit_bias = bias;
                opts = Object.assign({}, opts, { body: JSON.stringify(b) });
              }
              return f(url, opts);
            };
            window.k3TestLongReply = true;""", never_end_bias())
        self.send("Tell me about the function returns.", 2000)
        box = wait_for(lambda: (self.assistant_boxes() or [None])[-1], 10, "the reply box")
        lengths = []
        end = time.time() + 60
        while time.time() < end and len(set(lengths)) < 6:
            lengths.append(len(self.reply_text(box)))
            time.sleep(0.02)
        distinct = sorted(set(lengths))
        self.assertGreaterEqual(len(distinct), 4, f"the reply did not stream (lengths seen: {distinct})")
        self.assertFalse(d.find_element(By.ID, "stop").get_property("disabled"), "Stop is disabled while streaming")
        d.find_element(By.ID, "stop").click()
        usage = box.find_element(By.CSS_SELECTOR, ".usage")
        wait_for(lambda: "stopped" in usage.text, 10, "'stopped' in the usage line after Stop")
        self.assertTrue(d.find_element(By.ID, "stop").get_property("disabled"))
        self.assertFalse(d.find_element(By.ID, "send").get_property("disabled"))
        stopped_at = len(self.reply_text(box))
        time.sleep(0.5)
        self.assertEqual(len(self.reply_text(box)), stopped_at, "text kept arriving after Stop")

        # 2. The page keeps working: a short reply completes with the usage line.
        d.execute_script("window.k3TestLongReply = false;")
        self.send("What is a file?", 48)
        wait_for(lambda: len(self.assistant_boxes()) == 2, 10, "the second reply box")
        box2 = self.assistant_boxes()[-1]
        usage2 = box2.find_element(By.CSS_SELECTOR, ".usage")
        wait_for(lambda: "finish:" in usage2.text, 60, "the usage line of the second reply")
        self.assertRegex(usage2.text, r"prompt \d+ tok \(\d+ cached\) \| completion \d+ tok \| finish: (stop|length)")
        self.assertTrue(self.reply_text(box2).strip(), "the second reply is empty")
        errors = d.find_elements(By.CSS_SELECTOR, ".msg.error")
        self.assertEqual(errors, [], "the page shows an error: " + " ".join(e.text for e in errors))

        shot = os.environ.get("K3_SCREENSHOT")
        if shot:
            d.save_screenshot(shot)
            print("screenshot:", shot)


if __name__ == "__main__":
    unittest.main(verbosity=2)
