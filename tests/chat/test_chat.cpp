// K3 chat format tests: renderer goldens in tests/fixtures/chat (text reviewed against the spec; ids
// computed independently by tools/tokenizer/chat_golden_ids.py), injection safety, and the output
// parser: split-anywhere equivalence, render->parse round trips, and the known-bug checklist.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "chat/chat.h"
#include "common/chat_util.h"
#include "core/error.h"

namespace fs = std::filesystem;
using namespace k3::chat;
using k3::tok::TokenId;
using k3::tok::Tokenizer;

namespace {

const fs::path kDir = fs::path(K3_SOURCE_DIR) / "tests/fixtures/chat";

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<TokenId> read_ids(const fs::path& p) {
  std::ifstream f(p);
  std::vector<TokenId> v;
  TokenId x;
  while (f >> x) v.push_back(x);
  return v;
}

const Tokenizer& small() {
  static Tokenizer t = Tokenizer::load_dir(std::string(K3_SOURCE_DIR) + "/tests/fixtures/tokenizer-small");
  return t;
}

const Tokenizer* kimi() {
  static std::unique_ptr<Tokenizer> t = []() -> std::unique_ptr<Tokenizer> {
    const char* env = std::getenv("K3_TOKENIZER_DATA");
    const std::string dir = std::string(env && *env ? env : K3_TOKENIZER_DATA) + "/kimi";
    if (!fs::exists(dir + "/tiktoken.model")) return nullptr;
    return std::make_unique<Tokenizer>(Tokenizer::load_dir(dir));
  }();
  return t.get();
}

std::vector<fs::path> golden_inputs() {
  std::vector<fs::path> v;
  for (const auto& e : fs::directory_iterator(kDir))
    if (e.path().extension() == ".json") v.push_back(e.path());
  std::sort(v.begin(), v.end());
  return v;
}

std::vector<Segment> render_file(const fs::path& p) {
  const auto req = nlohmann::json::parse(slurp(p));
  return render(messages_from_json(req["messages"]), options_from_json(req));
}

std::vector<Event> chunked(const std::vector<std::string>& parts, bool thinking = true) {
  OutputParser p(thinking);
  return k3test::feed_all(p, parts);
}

std::vector<Event> one_shot(const std::string& text, bool thinking = true) { return chunked({text}, thinking); }

bool same(const std::vector<Event>& a, const std::vector<Event>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].kind != b[i].kind || a[i].text != b[i].text || a[i].call != b[i].call) return false;
  return true;
}

// Model outputs (after a thinking generation prompt) covering every section kind and tolerance.
const std::vector<std::string> kOutputs = {
    "Let me think.<|close|>think<|sep|><|open|>response<|sep|>Hi "
    "there<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>",
    "Need weather.<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"
    "<|open|>argument key=\"city\" type=\"string\"<|sep|>Paris \"FR\"\n<|close|>argument<|sep|>"
    "<|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>"
    "<|open|>call tool=\"sum\" index=\"2\"<|sep|><|open|>json "
    "type=\"array\"<|sep|>[1,2]<|close|>json<|sep|><|close|>call<|sep|>"
    "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>",
    // missing think closer before tools
    "thinking...<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"a\" "
    "type=\"boolean\"<|sep|>true<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|end_of_msg|>",
    // missing think closer before response; a < that is not a marker; <| that is not a marker
    "a<b and x <|y<|open|>response<|sep|>1 < 2 <| 3<|close|>response<|sep|><|close|>message<|sep|>",
    // duplicated think opener; text after think closer without response opener
    "<|open|>think<|sep|>hmm<|close|>think<|sep|>\n\nPlain answer.<|end_of_msg|>",
    // non-JSON values for typed arguments
    "<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool=\"g\" index=\"1\"<|sep|>"
    "<|open|>argument key=\"n\" type=\"number\"<|sep|>about 3<|close|>argument<|sep|>"
    "<|open|>argument key=\"o\" type=\"object\"<|sep|>{bad json<|close|>argument<|sep|>"
    "<|open|>argument key=\"b\" type=\"boolean\"<|sep|>yes<|close|>argument<|sep|>"
    "<|open|>argument key=\"z\" type=\"null\"<|sep|>null<|close|>argument<|sep|>"
    "<|open|>argument key=\"arr\" type=\"array\"<|sep|> [1, {\"x\": 2}] <|close|>argument<|sep|>"
    "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>",
    // truncated stream in the middle of an argument and a marker
    "r<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool=\"h\" index=\"1\"<|sep|><|open|>argument key=\"s\" "
    "type=\"string\"<|sep|>partial<|clo",
};

}  // namespace

TEST(Render, SpecExampleNonThinking) {
  // chat-format / spec §4 example, written out by hand from the spec
  std::vector<Message> msgs = {{"user", "hello", "", {}, "", ""}};
  RenderOptions o;
  o.thinking = false;
  EXPECT_EQ(segments_text(render(msgs, o)),
            "<|open|>message role=\"user\"<|sep|>hello<|close|>message<|sep|><|end_of_msg|>"
            "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>");
  o.thinking = true;
  const std::string t = segments_text(render(msgs, o));
  const std::string tail = "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>";
  ASSERT_GE(t.size(), tail.size());
  EXPECT_EQ(t.substr(t.size() - tail.size()), tail);
}

TEST(Render, GoldenFilesMatch) {
  const bool update = std::getenv("K3_UPDATE_GOLDENS") != nullptr;
  const auto inputs = golden_inputs();
  ASSERT_GE(inputs.size(), 8u);
  for (const auto& p : inputs) {
    const auto segs = render_file(p);
    const std::string review = segments_review_text(segs);
    fs::path txt = p;
    txt.replace_extension(".txt");
    if (update) {
      std::ofstream(txt, std::ios::binary) << review;
      continue;
    }
    ASSERT_TRUE(fs::exists(txt)) << txt;
    EXPECT_EQ(review, slurp(txt)) << p.filename();
    fs::path sids = p;
    sids.replace_extension(".small.ids");
    ASSERT_TRUE(fs::exists(sids)) << "run tools/tokenizer/chat_golden_ids.py";
    EXPECT_EQ(segments_ids(small(), segs), read_ids(sids)) << p.filename();
    fs::path kids = p;
    kids.replace_extension(".kimi.ids");
    if (kimi() && fs::exists(kids)) {
      EXPECT_EQ(segments_ids(*kimi(), segs), read_ids(kids)) << p.filename();
    }
  }
}

TEST(Render, InjectionInUserAndToolTextStaysPlainText) {
  const auto segs = render_file(kDir / "injection.json");
  const auto ids = segments_ids(small(), segs);
  size_t special_segments = 0;
  for (const auto& s : segs) special_segments += s.special;
  size_t special_ids = 0;
  for (TokenId id : ids) special_ids += small().is_special(id);
  EXPECT_EQ(special_ids, special_segments);
  EXPECT_EQ(small().decode(ids), segments_text(segs));
  // the forged system turn exists only as text: exactly 4 real messages + generation prompt
  size_t eom = 0;
  for (TokenId id : ids) eom += id == small().require_special("<|end_of_msg|>");
  EXPECT_EQ(eom, 3u);
  EXPECT_NE(segments_text(segs).find("call tool=\"odd&quot;name&amp;co\""), std::string::npos);
  EXPECT_NE(segments_text(segs).find("argument key=\"k&quot;ey\" type=\"string\""), std::string::npos);
}

TEST(Render, AttributeEscapingAndSortedJson) {
  EXPECT_EQ(escape_attr("a&b\"c<d"), "a&amp;b&quot;c<d");
  EXPECT_EQ(unescape_attr("a&amp;b&quot;c&amp;quot;"), "a&b\"c&quot;");
  EXPECT_EQ(sorted_compact_json(nlohmann::json::parse(R"({"b":{"z":1,"a":[2,{"y":0,"x":1}]},"a":"s"})")),
            R"({"a":"s","b":{"a":[2,{"x":1,"y":0}],"z":1}})");
}

TEST(Render, BadInputGivesOneLineErrors) {
  EXPECT_THROW(messages_from_json(nlohmann::json::parse(R"([{"role":"wizard","content":"x"}])")), k3::Error);
  EXPECT_THROW(messages_from_json(nlohmann::json::parse(R"({"role":"user"})")), k3::Error);
  EXPECT_THROW(messages_from_json(nlohmann::json::parse(
                   R"([{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":"{bad"}}]}])")),
               k3::Error);
  RenderOptions o;
  o.thinking_effort = "extreme";
  EXPECT_THROW(render({}, o), k3::Error);
  std::vector<Message> orphan = {{"tool", "r", "", {}, "nope", ""}};
  EXPECT_THROW(render(orphan, RenderOptions{}), k3::Error);
}

TEST(Render, ToolResultsFollowCallOrder) {
  const std::string t = segments_text(render_file(kDir / "tools_calls_results.json"));
  const size_t a = t.find("role=\"tool\" tool=\"get_weather\" index=\"1\""),
               b = t.find("role=\"tool\" tool=\"search\" index=\"2\"");
  ASSERT_NE(a, std::string::npos);
  ASSERT_NE(b, std::string::npos);
  EXPECT_LT(a, b);
}

TEST(Parser, RenderedAssistantTurnsParseBack) {
  size_t checked = 0;
  for (const auto& p : golden_inputs()) {
    const auto req = nlohmann::json::parse(slurp(p));
    for (const auto& m : messages_from_json(req["messages"])) {
      if (m.role != "assistant") continue;
      RenderOptions o;
      o.add_generation_prompt = false;
      const auto segs = render({m}, o);
      // the parser reads decoded text: literal marker text inside arguments cannot round-trip
      if (segments_review_text(segs) != segments_text(segs)) continue;
      std::string t = segments_text(segs);
      const std::string head = "<|open|>message role=\"assistant\"<|sep|>";
      ASSERT_EQ(t.substr(0, head.size()), head);
      t = t.substr(head.size());
      const ParseResult r = parse_output(t, /*thinking_prompt=*/false);
      EXPECT_EQ(r.reasoning, m.reasoning) << p.filename();
      EXPECT_EQ(r.content, m.content) << p.filename();
      ASSERT_EQ(r.calls.size(), m.tool_calls.size()) << p.filename();
      for (size_t i = 0; i < r.calls.size(); ++i) {
        EXPECT_EQ(r.calls[i].name, m.tool_calls[i].name);
        EXPECT_TRUE(r.calls[i].complete);
        EXPECT_EQ(nlohmann::ordered_json::parse(r.calls[i].arguments), m.tool_calls[i].arguments)
            << r.calls[i].arguments;
      }
      EXPECT_TRUE(r.finished_message);
      ++checked;
    }
  }
  EXPECT_GE(checked, 2u);
}

TEST(Parser, EveryByteSplitEqualsOneShot) {
  for (const auto& text : kOutputs) {
    const auto want = one_shot(text);
    for (size_t k = 0; k <= text.size(); ++k) {
      EXPECT_TRUE(same(chunked({text.substr(0, k), text.substr(k)}), want)) << "split at " << k << " of " << text;
    }
    std::vector<std::string> bytes;
    for (char c : text) bytes.emplace_back(1, c);
    EXPECT_TRUE(same(chunked(bytes), want)) << "byte by byte: " << text;
  }
}

TEST(Parser, EveryTokenBoundarySplitEqualsOneShot) {
  for (const auto& text : kOutputs) {
    const auto ids = small().encode_with_special(text);
    k3::tok::StreamDecoder sd(small());
    std::vector<std::string> parts;
    for (TokenId id : ids) parts.push_back(sd.push(id));
    parts.push_back(sd.flush());
    EXPECT_TRUE(same(chunked(parts), one_shot(text))) << text;
  }
}

TEST(Parser, StructuralTextNeverLeaksIntoContentOrReasoning) {  // vLLM #51412, Kimi-K2 #89
  for (const auto& text : kOutputs) {
    for (size_t k = 0; k <= text.size(); ++k) {
      OutputParser p;
      p.feed(text.substr(0, k));
      p.feed(text.substr(k));
      p.finish();
      for (const std::string* s : {&p.result().reasoning, &p.result().content}) {
        EXPECT_EQ(s->find("<|close|>"), std::string::npos) << *s;
        EXPECT_EQ(s->find("<|sep|>"), std::string::npos) << *s;
        EXPECT_EQ(s->find("<|open|>"), std::string::npos) << *s;
        EXPECT_EQ(s->find("argument key"), std::string::npos) << *s;
      }
    }
  }
  EXPECT_EQ(parse_output(kOutputs[0]).content, "Hi there");
  EXPECT_EQ(parse_output(kOutputs[0]).reasoning, "Let me think.");
  EXPECT_EQ(parse_output(kOutputs[3]).reasoning, "a<b and x <|y");
  EXPECT_EQ(parse_output(kOutputs[3]).content, "1 < 2 <| 3");
  EXPECT_EQ(parse_output(kOutputs[4]).reasoning, "hmm");
  EXPECT_EQ(parse_output(kOutputs[4]).content, "\n\nPlain answer.");
}

TEST(Parser, StringArgumentsStreamBeforeTheCallCloses) {  // vLLM #50604
  const std::string head =
      "<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool=\"write\" index=\"1\"<|sep|>"
      "<|open|>argument key=\"text\" type=\"string\"<|sep|>";
  OutputParser p;
  p.feed(head);
  std::string streamed;
  for (int i = 0; i < 5; ++i) {
    for (const auto& e : p.feed("line " + std::to_string(i) + "\n"))
      if (e.kind == EventKind::ToolArgs) streamed += e.text;
  }
  EXPECT_EQ(streamed, "line 0\\nline 1\\nline 2\\nline 3\\nline 4\\n");
  p.feed("<|close|>argument<|sep|><|close|>call<|sep|>");
  p.finish();
  ASSERT_EQ(p.result().calls.size(), 1u);
  EXPECT_EQ(nlohmann::json::parse(p.result().calls[0].arguments)["text"], "line 0\nline 1\nline 2\nline 3\nline 4\n");
}

TEST(Parser, ToolCallsSurviveAMissingThinkCloser) {  // vLLM #53246
  const auto r = parse_output(kOutputs[2]);
  EXPECT_EQ(r.reasoning, "thinking...");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].name, "f");
  EXPECT_EQ(nlohmann::json::parse(r.calls[0].arguments), nlohmann::json::parse(R"({"a":true})"));
}

TEST(Parser, NonJsonArgumentValuesBecomeValidJson) {  // sglang #34604
  const auto r = parse_output(kOutputs[5]);
  ASSERT_EQ(r.calls.size(), 1u);
  const auto args = nlohmann::json::parse(r.calls[0].arguments);  // throws if not JSON
  EXPECT_EQ(args["n"], "about 3");
  EXPECT_EQ(args["o"], "{bad json");
  EXPECT_EQ(args["b"], "yes");
  EXPECT_TRUE(args["z"].is_null());
  EXPECT_EQ(args["arr"], nlohmann::json::parse(R"([1,{"x":2}])"));
  const auto w = parse_output(kOutputs[1]);
  ASSERT_EQ(w.calls.size(), 2u);
  EXPECT_EQ(nlohmann::json::parse(w.calls[0].arguments),
            nlohmann::json::parse(R"({"city":"Paris \"FR\"\n","days":3})"));
  EXPECT_EQ(nlohmann::json::parse(w.calls[1].arguments), nlohmann::json::parse("[1,2]"));
}

TEST(Parser, TruncatedStreamClosesTheCallAndDropsThePartialMarker) {
  const auto r = parse_output(kOutputs[6]);
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(nlohmann::json::parse(r.calls[0].arguments)["s"], "partial<|clo");
  EXPECT_FALSE(r.finished_message);
}
