"""End-to-end tests of `k3 serve` with the official OpenAI Python client (tests/server/requirements.txt).

Each TestCase starts its own `k3 serve --port 0` on 127.0.0.1 with the bundled K3-nano and stops it.
Run by ctest (tests/server/CMakeLists.txt) with the venv's python; exits 77 (skipped) with a message
when the openai package is missing. K3_SANITIZED=1 (ASan build) skips the load and RSS tests.
"""
import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import unittest
import urllib.error
import urllib.request

try:
    from openai import OpenAI
    import openai
except ImportError:
    print("SKIPPED: the openai package is not installed (bash scripts/test.sh makes build/servevenv)")
    sys.exit(77)

K3 = os.environ.get("K3_BIN", "build/bin/k3")
SANITIZED = os.environ.get("K3_SANITIZED", "0") == "1"
# mpirun of the Open MPI k3 was built with (empty: built without MPI): a server of 2 processes.
MPIEXEC = os.environ.get("K3_MPIEXEC", "")
MPI_ENV = {"OMPI_MCA_rtc": "^hwloc", "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
           "OMPI_MCA_mpi_yield_when_idle": "1", "PMIX_MCA_gds": "hash"}


def mpirun(n):
    return [MPIEXEC, "--allow-run-as-root", "--oversubscribe", "-np", str(n)]
MODEL = "k3-nano"


class Server:
    """A `k3 serve` process on a free loopback port."""

    def __init__(self, *args, launcher=()):
        env = dict(os.environ, **MPI_ENV) if launcher else None
        self.proc = subprocess.Popen([*launcher, K3, "serve", "--port", "0", "-q", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.url = None
        deadline = time.time() + 120
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("k3 serve exited: " + self.proc.stderr.read())
            m = re.search(r"ready: (http://\S+)", line)
            if m:
                self.url = m.group(1)
                break
        if not self.url:
            raise RuntimeError("k3 serve did not get ready")
        self.port = int(self.url.rsplit(":", 1)[1])

    def client(self, **kw):
        return OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()

    def http(self, method, path, body=None, headers=None, raw=None):
        """(status, parsed JSON or text, headers) of one request."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status, text, hdrs = r.status, r.read().decode("utf-8", "replace"), r.headers
        except urllib.error.HTTPError as e:
            status, text, hdrs = e.code, e.read().decode("utf-8", "replace"), e.headers
        try:
            return status, json.loads(text), hdrs
        except ValueError:
            return status, text, hdrs

    def metric(self, name):
        _, text, _ = self.http("GET", "/metrics")
        m = re.search(r"^" + re.escape(name) + r" (\S+)$", text, re.M)
        return float(m.group(1))

    def rss_kib(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmRSS")


def k3_tokenize_count(text):
    out = subprocess.run([K3, "tokenize", "--text", text], capture_output=True, text=True, check=True).stdout
    return len(re.findall(r"-?\d+", out.split("\n")[0])) if out.strip() else 0


def user(text):
    return [{"role": "user", "content": text}]


def reasoning_of(msg):
    return getattr(msg, "reasoning_content", None) or ""


class Basics(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.s = Server("--parallel", "4", "--max-body", "64K")
        cls.c = cls.s.client()

    @classmethod
    def tearDownClass(cls):
        cls.s.stop()

    def test_models(self):
        ids = [m.id for m in self.c.models.list().data]
        self.assertEqual(ids, [MODEL])

    def test_chat_stream_equals_nonstream(self):
        kw = dict(model=MODEL, messages=user("What is a file system?"), max_tokens=12, temperature=0)
        r = self.c.chat.completions.create(**kw)
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.usage.completion_tokens, 12)
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + 12)
        full = reasoning_of(r.choices[0].message) + (r.choices[0].message.content or "")
        self.assertTrue(reasoning_of(r.choices[0].message), "the thinking prompt puts the output in reasoning_content")
        text, usage, finish = "", None, None
        for ch in self.c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            if ch.usage is not None:
                usage = ch.usage
            for c in ch.choices:
                text += (getattr(c.delta, "reasoning_content", None) or "") + (c.delta.content or "")
                finish = c.finish_reason or finish
        self.assertEqual(text, full)
        self.assertEqual(finish, "length")
        self.assertEqual(usage.completion_tokens, 12)
        self.assertEqual(usage.prompt_tokens, r.usage.prompt_tokens)
        # usage.prompt_tokens is the rendered prompt's length
        _, tok, _ = self.s.http("POST", "/tokenize", {"messages": user("What is a file system?")})
        self.assertEqual(usage.prompt_tokens, len(tok["tokens"]))

    def test_ignore_eos_runs_to_max_tokens(self):
        # the chat-tuned model closes this answer well before 300 tokens; ignore_eos goes on
        kw = dict(model=MODEL, messages=user("What is a socket?"), max_tokens=300, temperature=0)
        r = self.c.chat.completions.create(**kw)
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertLess(r.usage.completion_tokens, 300)
        shown = reasoning_of(r.choices[0].message) + (r.choices[0].message.content or "")
        r2 = self.c.chat.completions.create(**kw, extra_body={"ignore_eos": True})
        self.assertEqual(r2.choices[0].finish_reason, "length")
        self.assertEqual(r2.usage.completion_tokens, 300)
        self.assertEqual(reasoning_of(r2.choices[0].message) + (r2.choices[0].message.content or ""), shown)

    def test_thinking_off_gives_content(self):
        r = self.c.chat.completions.create(model=MODEL, messages=user("Say something."), max_tokens=6, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        self.assertTrue(r.choices[0].message.content)
        self.assertFalse(reasoning_of(r.choices[0].message))

    def test_completion_usage_equals_k3_tokenize(self):
        prompt = "The function returns"
        r = self.c.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
        self.assertEqual(r.usage.prompt_tokens, k3_tokenize_count(prompt))
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.usage.completion_tokens, 10)
        self.assertEqual(k3_tokenize_count(r.choices[0].text), 10)  # greedy K3-nano text re-tokenizes to itself

    def test_completion_token_ids_and_echo_logprobs(self):
        _, tok, _ = self.s.http("POST", "/tokenize", {"content": "The function returns"})
        r = self.c.completions.create(model=MODEL, prompt=tok["tokens"], max_tokens=4, temperature=0, echo=True,
                                      logprobs=2)
        lp = r.choices[0].logprobs
        self.assertTrue(r.choices[0].text.startswith("The function returns"))
        self.assertEqual(len(lp.tokens), len(tok["tokens"]) + 4)
        self.assertIsNone(lp.token_logprobs[0])
        self.assertTrue(all(x <= 0 for x in lp.token_logprobs[1:]))
        _, det, _ = self.s.http("POST", "/detokenize", {"tokens": tok["tokens"]})
        self.assertEqual(det["content"], "The function returns")

    def test_chat_logprobs(self):
        r = self.c.chat.completions.create(model=MODEL, messages=user("Hello"), max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=3)
        content = r.choices[0].logprobs.content
        self.assertEqual(len(content), 5)
        for e in content:
            self.assertEqual(len(e.top_logprobs), 3)
            self.assertAlmostEqual(e.logprob, e.top_logprobs[0].logprob, places=4)  # greedy picks the top token

    def test_json_object(self):
        r = self.c.chat.completions.create(model=MODEL, messages=user("Reply with a JSON object."), max_tokens=60,
                                           temperature=0.8, seed=5, response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            self.assertIsInstance(json.loads(r.choices[0].message.content), dict)
        else:
            self.assertEqual(r.choices[0].finish_reason, "length")

    def test_stop_sequence(self):
        base = self.c.completions.create(model=MODEL, prompt="The function returns", max_tokens=12, temperature=0)
        word = base.choices[0].text.split()[2]
        r = self.c.completions.create(model=MODEL, prompt="The function returns", max_tokens=12, temperature=0,
                                      stop=[word])
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertEqual(r.choices[0].text, base.choices[0].text[:base.choices[0].text.index(word)])

    def test_seeded_sampling_repeats(self):
        kw = dict(model=MODEL, prompt="The server", max_tokens=8, temperature=0.9, seed=42)
        self.assertEqual(self.c.completions.create(**kw).choices[0].text, self.c.completions.create(**kw).choices[0].text)

    # ---- faults: each a JSON error with the right status; the server keeps serving
    def assert_error(self, status, body, code=None, param=None, path="/v1/chat/completions", raw=None):
        st, j, _ = self.s.http("POST", path, body, {"Content-Type": "application/json"}, raw=raw)
        self.assertEqual(st, status, j)
        self.assertIn("error", j)
        self.assertIsInstance(j["error"]["message"], str)
        if code:
            self.assertEqual(j["error"]["code"], code, j)
        if param:
            self.assertEqual(j["error"]["param"], param, j)

    def test_faults(self):
        self.assert_error(400, None, "invalid_json", raw=b'{"messages": [')
        self.assert_error(400, {"messages": user("hi"), "temperature": "hot"}, "invalid_type", "temperature")
        self.assert_error(400, {"messages": user("hi"), "max_tokens": "ten"}, "invalid_type", "max_tokens")
        self.assert_error(400, {"messages": "hi"}, param="messages")
        self.assert_error(404, {"model": "gpt-5", "messages": user("hi")}, "model_not_found")
        self.assert_error(400, {"messages": user("hi"), "functions": [], "audio": {}}, "unsupported_parameter")
        self.assert_error(400, {"messages": user("word " * 5000)}, "context_length_exceeded")
        self.assert_error(400, {"messages": user("hi"), "max_tokens": 100000}, "context_length_exceeded", "max_tokens")
        self.assert_error(400, None, "invalid_json", raw=b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}')
        self.assert_error(400, {"prompt": [1, 2, 99999999]}, param="prompt", path="/v1/completions")
        self.assert_error(400, {"messages": user("hi"), "n": 3}, param="n")
        self.assert_error(413, {"messages": user("x" * 70000)})
        st, j, _ = self.s.http("GET", "/no/such/route")
        self.assertEqual(st, 404)
        self.assertIn("error", j)
        # still serving
        self.assertEqual(self.c.models.list().data[0].id, MODEL)

    def running(self):
        return self.s.metric("k3_running_sequences")

    def test_disconnect_mid_stream_frees_the_slot(self):
        body = json.dumps({"model": MODEL, "messages": user("Tell me a long story."), "max_tokens": 2000,
                           "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", self.s.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while got.count(b"data: ") < 3:
            got += sock.recv(4096)
        self.assertEqual(self.running(), 1)
        sock.close()
        deadline = time.time() + 5
        while self.running() != 0 and time.time() < deadline:
            time.sleep(0.05)
        self.assertEqual(self.running(), 0, "the disconnected request still holds its sequence")
        self.assertEqual(self.c.models.list().data[0].id, MODEL)

    def test_slow_client_does_not_block_others(self):
        body = json.dumps({"model": MODEL, "prompt": "The", "max_tokens": 40, "stream": True,
                           "temperature": 0}).encode()
        sock = socket.create_connection(("127.0.0.1", self.s.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        t0 = time.time()
        r = self.c.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
        self.assertEqual(r.usage.completion_tokens, 3)
        self.assertLess(time.time() - t0, 30)
        got = b""
        sock.settimeout(60)
        while b"[DONE]" not in got:
            chunk = sock.recv(64)  # slowly, in small pieces
            if not chunk:
                break
            got += chunk
            time.sleep(0.005)
        sock.close()
        self.assertIn(b"[DONE]", got)
        self.assertIn(b'"finish_reason":"length"', got)


class ToolCalls(unittest.TestCase):
    """The chat-tuned K3-nano calls tools through the API: held-out tool prompts of
    tests/fixtures/k3-nano-chat (the engine's own test counts 38 of 40 well-formed calls), each
    non-streamed and streamed; the streamed call arrives in pieces that add up to the same call."""

    @classmethod
    def setUpClass(cls):
        cls.s = Server("--parallel", "4")
        cls.c = cls.s.client()
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "k3-nano-chat",
                            "tool_prompts.jsonl")
        with open(path, encoding="utf-8") as f:
            cls.prompts = [json.loads(line) for line in f if line.strip()][:6]

    @classmethod
    def tearDownClass(cls):
        cls.s.stop()

    def request(self, p):
        msgs = ([{"role": "system", "content": p["system"]}] if p["system"] else []) + user(p["user"])
        kw = dict(model=MODEL, messages=msgs, tools=p["tools"], max_tokens=256, temperature=0,
                  tool_choice="required" if p["tool_choice_required"] else "auto")
        if p["reasoning_effort"]:
            kw["reasoning_effort"] = p["reasoning_effort"]
        if not p["thinking"] and not p["reasoning_effort"]:
            kw["extra_body"] = {"chat_template_kwargs": {"enable_thinking": False}}
        return kw

    def test_tool_calls_stream_and_nonstream(self):
        well_formed = 0
        for p in self.prompts:
            kw = self.request(p)
            declared = {t["function"]["name"]: t["function"]["parameters"] for t in p["tools"]}
            r = self.c.chat.completions.create(**kw)
            calls = r.choices[0].message.tool_calls or []
            if not calls:
                continue
            self.assertEqual(r.choices[0].finish_reason, "tool_calls", p["id"])
            call = calls[0]
            self.assertTrue(call.id.startswith("call_"), call.id)
            self.assertEqual(call.type, "function")
            args = json.loads(call.function.arguments)  # a JSON string of an object
            self.assertIsInstance(args, dict)
            if call.function.name in declared and all(k in args for k in declared[call.function.name].get("required", [])):
                well_formed += 1
            # streamed: the same calls, the arguments in more than one piece
            pieces, got = {}, {}
            finish = None
            for ch in self.c.chat.completions.create(**kw, stream=True):
                for c in ch.choices:
                    finish = c.finish_reason or finish
                    for tc in c.delta.tool_calls or []:
                        slot = got.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                        if tc.id:
                            slot["id"] = tc.id
                        if tc.function and tc.function.name:
                            slot["name"] += tc.function.name
                        if tc.function and tc.function.arguments:
                            slot["arguments"] += tc.function.arguments
                            pieces[tc.index] = pieces.get(tc.index, 0) + 1
            self.assertEqual(finish, "tool_calls", p["id"])
            self.assertEqual([(g["name"], json.loads(g["arguments"])) for _, g in sorted(got.items())],
                             [(c.function.name, json.loads(c.function.arguments)) for c in calls], p["id"])
            self.assertTrue(all(g["id"] and g["id"].startswith("call_") for g in got.values()))
            self.assertGreater(pieces.get(0, 0), 1, "the arguments arrived in one piece: " + p["id"])
        self.assertGreaterEqual(well_formed, len(self.prompts) - 1,
                                f"{well_formed} of {len(self.prompts)} held-out tool prompts gave a well-formed call")


class AuthAndCors(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.s = Server("--api-key", "s3cret", "--cors", "http://app.test")

    @classmethod
    def tearDownClass(cls):
        cls.s.stop()

    def test_key_required(self):
        with self.assertRaises(openai.AuthenticationError):
            self.s.client(api_key="wrong").models.list()
        st, j, _ = self.s.http("GET", "/v1/models")
        self.assertEqual(st, 401)
        self.assertEqual(j["error"]["code"], "invalid_api_key")
        self.assertEqual(self.s.client(api_key="s3cret").models.list().data[0].id, MODEL)
        st, _, _ = self.s.http("GET", "/health")
        self.assertEqual(st, 200)
        st, page, _ = self.s.http("GET", "/")
        self.assertEqual(st, 200)
        self.assertIn("k3 serve", page)

    def test_cors(self):
        st, _, h = self.s.http("OPTIONS", "/v1/chat/completions", headers={"Origin": "http://app.test"})
        self.assertEqual(st, 204)
        self.assertEqual(h["Access-Control-Allow-Origin"], "http://app.test")


class NoCors(unittest.TestCase):
    def test_no_cors_headers_by_default(self):
        s = Server()
        try:
            _, _, h = s.http("GET", "/v1/models", headers={"Origin": "http://evil.test"})
            self.assertIsNone(h.get("Access-Control-Allow-Origin"))
        finally:
            s.stop()


class QueueFull(unittest.TestCase):
    def test_429_beyond_the_queue(self):
        s = Server("--parallel", "1", "--max-queue", "1")
        try:
            def one(i):
                return s.http("POST", "/v1/completions", {"prompt": f"Request {i}", "max_tokens": 40,
                                                          "temperature": 0})
            with concurrent.futures.ThreadPoolExecutor(6) as ex:
                results = list(ex.map(one, range(6)))
            codes = sorted(r[0] for r in results)
            self.assertIn(429, codes)
            self.assertIn(200, codes)
            self.assertEqual(set(codes), {200, 429})
            for st, j, _ in results:
                if st == 429:
                    self.assertEqual(j["error"]["code"], "queue_full")
        finally:
            s.stop()


PROMPTS = [f"Question {i}: what does the {w} option of the {t} do?" for i, (w, t) in enumerate(
    (w, t) for w in ("verbose", "quiet", "force", "recursive", "debug", "output", "input", "config")
    for t in ("compiler", "kernel", "shell", "server", "database", "linker", "editor", "mailer"))]


@unittest.skipIf(SANITIZED, "load test skipped in the sanitizer build (run by the release build)")
class NoCrossingUnderLoad(unittest.TestCase):
    def test_64_concurrent_streams_equal_solo(self):
        self.assertEqual(len(set(PROMPTS)), 64)
        s = Server("--parallel", "16", "--max-queue", "64")
        try:
            c = s.client(timeout=600)
            kw = dict(model=MODEL, max_tokens=8, temperature=0)
            solo = [c.chat.completions.create(messages=user(p), **kw) for p in PROMPTS]
            solo_text = [reasoning_of(r.choices[0].message) + (r.choices[0].message.content or "") for r in solo]

            def stream(p):
                text, n = "", 0
                for ch in c.chat.completions.create(messages=user(p), stream=True,
                                                    stream_options={"include_usage": True}, **kw):
                    for x in ch.choices:
                        text += (getattr(x.delta, "reasoning_content", None) or "") + (x.delta.content or "")
                    if ch.usage is not None:
                        n = ch.usage.completion_tokens
                return text, n

            with concurrent.futures.ThreadPoolExecutor(64) as ex:
                got = list(ex.map(stream, PROMPTS))
            for i, (text, n) in enumerate(got):
                self.assertEqual(text, solo_text[i], f"prompt {i}: concurrent output differs from solo")
                self.assertEqual(n, 8)
            self.assertGreater(s.metric("k3_batch_sequences_sum") / s.metric("k3_batch_sequences_count"), 1.5,
                               "requests were not batched")
        finally:
            s.stop()


@unittest.skipIf(SANITIZED, "load test skipped in the sanitizer build (run by the release build)")
class SplitModelServes(unittest.TestCase):
    # The model split over 2 ranks (--tp 2 --ep 2, docs/multi-gpu.md): 16 concurrent streams, each
    # equal to the same prompt answered alone by a one-rank server, with a multi-turn chat whose
    # second turn comes from the prefix cache. Ranks as threads of the server, then as 2 processes
    # under mpirun (rank 0 serves, rank 1 follows its steps, pool operations and snapshots).
    def test_split_concurrent_streams_equal_one_rank_solo(self):
        self.check_split("--tp", "2", "--ep", "2", "--parallel", "8")

    @unittest.skipIf(not MPIEXEC, "k3 was built without MPI (libopenmpi-dev): no server of 2 processes")
    def test_split_over_two_processes(self):
        self.check_split("-t", "1", "--tp", "2", "--ep", "2", "--parallel", "8", launcher=mpirun(2))

    def check_split(self, *args, launcher=()):
        kw = dict(model=MODEL, max_tokens=8, temperature=0)
        one = Server()
        try:
            c = one.client(timeout=600)
            solo = [c.chat.completions.create(messages=user(p), **kw) for p in PROMPTS[:16]]
            solo_text = [reasoning_of(r.choices[0].message) + (r.choices[0].message.content or "") for r in solo]
            one_turns = converse(one, max_tokens=16)[0]
        finally:
            one.stop()
        s = Server(*args, launcher=launcher)
        try:
            c = s.client(timeout=600)

            def stream(p):
                text = ""
                for ch in c.chat.completions.create(messages=user(p), stream=True, **kw):
                    for x in ch.choices:
                        text += (getattr(x.delta, "reasoning_content", None) or "") + (x.delta.content or "")
                return text

            with concurrent.futures.ThreadPoolExecutor(16) as ex:
                got = list(ex.map(stream, PROMPTS[:16]))
            for i, text in enumerate(got):
                self.assertEqual(text, solo_text[i], f"prompt {i}: the split server's output differs from one rank's")
            split_turns, cached = converse(s, max_tokens=16)[:2]
            self.assertEqual(split_turns, one_turns)
            self.assertGreater(sum(cached), 0, "the prefix cache served nothing on the split model")
        finally:
            s.stop()


TURNS = ["What is a file system?", "How do I mount one?", "What does fsck check?", "Explain inodes.",
         "What is a journal?", "How big can a file be?", "What are hard links?", "And symbolic links?",
         "How are permissions stored?", "Summarize the conversation."]


def converse(s, max_tokens=64):
    c = s.client(timeout=600)
    msgs, outs, cached = [], [], []
    for t in TURNS:
        msgs.append({"role": "user", "content": t})
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=max_tokens, temperature=0)
        m = r.choices[0].message
        outs.append((reasoning_of(m), m.content or ""))
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        reply = {"role": "assistant", "content": m.content or ""}
        if reasoning_of(m):
            reply["reasoning_content"] = reasoning_of(m)
        msgs.append(reply)
    return outs, cached, s.metric("k3_prefill_tokens_computed_total"), s.metric("k3_prompt_tokens_total")


@unittest.skipIf(SANITIZED, "prefix-cache ratio test skipped in the sanitizer build (run by the release build)")
class PrefixCache(unittest.TestCase):
    def test_ten_turns(self):
        # fp32 numerics: restored decode-fed states match a cold prefill to ~2e-6 (docs/server.md)
        on = Server("--numerics", "fp32", "--prefix-cache-mem", "256M")
        try:
            outs_on, cached_on, prefill_on, prompt_on = converse(on)
        finally:
            on.stop()
        off = Server("--numerics", "fp32", "--prefix-cache-mem", "0")
        try:
            outs_off, cached_off, prefill_off, prompt_off = converse(off)
        finally:
            off.stop()
        self.assertEqual(outs_on, outs_off, "output with the cache differs from output without it")
        self.assertEqual(prompt_on, prompt_off)
        self.assertEqual(prefill_off, prompt_off)
        self.assertEqual(cached_off, [0] * 10)
        self.assertTrue(all(x > 0 for x in cached_on[1:]), cached_on)
        ratio = prefill_on / prefill_off
        print(f"prefix cache: {prefill_on:.0f} of {prefill_off:.0f} prompt tokens computed ({100 * ratio:.1f}%)")
        self.assertLess(ratio, 0.15)


@unittest.skipIf(SANITIZED, "RSS test skipped in the sanitizer build (ASan's quarantine grows RSS by design)")
class Rss(unittest.TestCase):
    def test_rss_flat_over_1000_mixed_requests(self):
        # --max-queue 8: 20 HTTP worker threads; each thread that serves a request can grow its own malloc
        # arena, which is growth by thread count, not by request count.
        s = Server("--parallel", "4", "--max-queue", "8", "--prefix-cache-mem", "4M")
        try:
            c = s.client(timeout=120)

            def one(i):
                k = i % 6
                try:
                    if k == 0:
                        c.chat.completions.create(model=MODEL, messages=user(f"Hi {i}"), max_tokens=2)
                    elif k == 1:
                        for _ in c.chat.completions.create(model=MODEL, messages=user(f"Yo {i}"), max_tokens=2,
                                                           stream=True):
                            pass
                    elif k == 2:
                        c.completions.create(model=MODEL, prompt=f"Text {i}", max_tokens=2, logprobs=1)
                    elif k == 3:
                        s.http("POST", "/v1/chat/completions", raw=b'{"broken')
                    elif k == 4:
                        s.http("POST", "/tokenize", {"content": f"tokens {i}"})
                    else:
                        c.chat.completions.create(model=MODEL, messages=user(f"J {i}"), max_tokens=3,
                                                  response_format={"type": "json_object"})
                except openai.APIError:
                    pass

            with concurrent.futures.ThreadPoolExecutor(4) as ex:
                list(ex.map(one, range(100)))
                rss100 = s.rss_kib()
                list(ex.map(one, range(100, 1000)))
            rss1000 = s.rss_kib()
            print(f"RSS after 100 requests {rss100} KiB, after 1000 {rss1000} KiB")
            self.assertLess(abs(rss1000 - rss100) / rss100, 0.05)
        finally:
            s.stop()


class KimiLinearK2(unittest.TestCase):
    """A Kimi Linear checkpoint (tests/fixtures/kl-tiny, random weights) with the K2 test tokenizer:
    the server picks the K2 chat format, /tokenize renders every K2 golden conversation to the ids the
    Jinja template gives (tests/fixtures/chat-k2, checked by tools/chat/check_k2_goldens.py), and chat
    completions run (stream == non-stream, usage counts the rendered prompt)."""

    @classmethod
    def setUpClass(cls):
        fx = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures")
        cls.goldens = os.path.join(fx, "chat-k2")
        cls.s = Server("-m", os.path.join(fx, "kl-tiny"), "--tokenizer", os.path.join(fx, "tokenizer-k2-tiny"),
                       "--parallel", "2")
        cls.c = cls.s.client()

    @classmethod
    def tearDownClass(cls):
        cls.s.stop()

    def test_prompts_are_the_templates_ids(self):
        names = sorted(n[:-5] for n in os.listdir(self.goldens) if n.endswith(".json"))
        compared = 0
        for name in names:
            with open(os.path.join(self.goldens, name + ".json")) as f:
                conv = json.load(f)
            if conv.get("add_generation_prompt", True) is False:
                continue  # a server prompt always ends with the assistant's opening
            compared += 1
            with open(os.path.join(self.goldens, name + ".ids")) as f:
                want = [int(x) for x in f.read().split()]
            status, tok, _ = self.s.http("POST", "/tokenize", conv)
            self.assertEqual(status, 200, (name, tok))
            self.assertEqual(tok["tokens"], want, name)
        self.assertGreaterEqual(compared, 5)

    def test_chat_runs(self):
        kw = dict(model=self.c.models.list().data[0].id, messages=user("Hi!"), max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True})
        r = self.c.chat.completions.create(**kw)
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.usage.completion_tokens, 6)
        _, tok, _ = self.s.http("POST", "/tokenize", {"messages": user("Hi!")})
        self.assertEqual(r.usage.prompt_tokens, len(tok["tokens"]))
        text = ""
        for ch in self.c.chat.completions.create(**kw, stream=True):
            for c in ch.choices:
                text += (getattr(c.delta, "reasoning_content", None) or "") + (c.delta.content or "")
        full = (getattr(r.choices[0].message, "reasoning_content", None) or "") + (r.choices[0].message.content or "")
        self.assertEqual(text, full)


if __name__ == "__main__":
    unittest.main(verbosity=2)
