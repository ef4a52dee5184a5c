// The bundled K3-nano answers in the K3 chat format (issue 17 part 3): greedy replies (temperature
// 0, at most 256 tokens, fast numerics) through the runtime chat path (ChatSession: the canonical
// rendering, prefill, decode, and the engine's incremental output parser) for held-out prompts whose
// source documents were not in the chat fine-tune (tests/fixtures/k3-nano-chat/, written by
// tools/chat/build_chat_data.py):
//  - questions.jsonl: >= 90% of the replies close the thinking section (or, for a non-thinking prompt,
//    never open one) and give a non-empty answer;
//  - tool_prompts.jsonl: >= 80% of the replies hold a complete call of a declared tool whose arguments
//    are a JSON object with the schema's required keys (a stricter count, also checking that every
//    argument is declared, of its declared type and within its enum, is printed but not asserted).
// Each prompt's rendering by the engine equals the ids the fine-tune data was rendered with (the
// Python renderer tools/chat/xtml.py). K3_NANO_CHAT_JSON=FILE writes the figures and every reply
// (scripts/k3_nano_chat_eval.sh); K3_NANO_CHAT_MODEL=DIR runs another checkpoint instead of models/k3-nano.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "chat/chat.h"
#include "model/model.h"
#include "runtime/chat_session.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// K3_NANO_CHAT_MODEL=DIR evaluates another checkpoint of the same vocabulary (candidates of a fine-tune).
fs::path nano() {
  const char* m = std::getenv("K3_NANO_CHAT_MODEL");
  return m && *m ? fs::path(m) : fs::path(K3_SOURCE_DIR) / "models/k3-nano";
}
fs::path fixtures() { return fs::path(K3_SOURCE_DIR) / "tests/fixtures/k3-nano-chat"; }

constexpr int64_t kMaxTokens = 256;
constexpr double kMinAnswered = 0.90;
constexpr double kMinToolCalls = 0.80;

std::vector<json> read_jsonl(const fs::path& p) {
  std::ifstream f(p);
  std::vector<json> out;
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) out.push_back(json::parse(line));
  return out;
}

struct Loaded {
  std::unique_ptr<k3::Model> model;
  k3::tok::Tokenizer tok;
};
const Loaded& nano_model() {
  static Loaded* l = new Loaded{k3::Model::load(nano().string()), k3::tok::Tokenizer::load_dir(nano().string())};
  return *l;
}

k3::ChatOptions options_of(const json& rec) {
  k3::ChatOptions o;
  o.system = rec.value("system", "");
  o.render.thinking_effort = rec.value("reasoning_effort", "");
  o.render.thinking = rec.value("thinking", true);
  o.render.tools = rec.value("tools", json::array());
  o.render.tool_choice_required = rec.value("tool_choice_required", false);
  o.sampling.temperature = 0.0f;  // greedy
  o.max_tokens = kMaxTokens;
  o.forward.numerics = k3::ops::Numerics::Fast;
  return o;
}

bool thinking_prompt(const k3::ChatOptions& o) { return o.render.thinking && o.render.thinking_effort != "none"; }

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

bool type_matches(const json& v, const std::string& t) {
  if (t == "string") return v.is_string();
  if (t == "integer") return v.is_number_integer() || (v.is_number_float() && v.get<double>() == double(int64_t(v.get<double>())));
  if (t == "number") return v.is_number();
  if (t == "boolean") return v.is_boolean();
  if (t == "array") return v.is_array();
  if (t == "object") return v.is_object();
  if (t == "null") return v.is_null();
  return true;
}

// Why a call is not well-formed ("" when it is), against the declared tools: the call was closed,
// names a declared tool, and its arguments are a JSON object holding the schema's required keys.
std::string call_problem(const k3::chat::ToolCall& c, bool complete, const json& tools) {
  if (!complete) return "call not closed";
  const json* params = nullptr;
  for (const auto& t : tools)
    if (t["function"]["name"] == c.name) params = &t["function"]["parameters"];
  if (!params) return "undeclared tool '" + c.name + "'";
  if (!c.arguments.is_object()) return "arguments are not a JSON object: " + c.arguments.dump();
  for (const auto& k : params->value("required", json::array()))
    if (!c.arguments.contains(k.get<std::string>())) return "missing required argument '" + k.get<std::string>() + "'";
  return "";
}

// Stricter, reported only: every argument is declared, of its declared type, and within its enum.
std::string strict_problem(const k3::chat::ToolCall& c, const json& tools) {
  json props = json::object();
  for (const auto& t : tools)
    if (t["function"]["name"] == c.name) props = t["function"]["parameters"].value("properties", json::object());
  for (const auto& [k, v] : c.arguments.items()) {
    if (!props.contains(k)) return "undeclared argument '" + k + "'";
    if (props[k].contains("type") && !type_matches(v, props[k]["type"].get<std::string>()))
      return "argument '" + k + "' is not of type " + props[k]["type"].get<std::string>();
    if (props[k].contains("enum") && std::find(props[k]["enum"].begin(), props[k]["enum"].end(), v) == props[k]["enum"].end())
      return "argument '" + k + "' is not one of its enum values";
  }
  return "";
}

struct Reply {
  std::string id, kind;
  k3::TurnResult turn;
  bool left_reasoning = false;  // the parser saw the reasoning section end (closer or next section)
  int calls_closed = 0;         // ToolCallEnd events
  double seconds = 0;
};

Reply run_prompt(const json& rec) {
  const auto& m = nano_model();
  const k3::ChatOptions o = options_of(rec);
  k3::ChatSession chat(*m.model, m.tok, o);
  Reply r;
  r.id = rec["id"];
  r.kind = rec["kind"];
  k3::TurnCallbacks cb;
  cb.on_event = [&](const k3::chat::Event& e) {
    if (e.kind != k3::chat::EventKind::Reasoning) r.left_reasoning = true;
    if (e.kind == k3::chat::EventKind::ToolCallEnd) ++r.calls_closed;
  };
  k3::chat::Message user;
  user.role = "user";
  user.content = rec["user"];
  const auto t0 = std::chrono::steady_clock::now();
  r.turn = chat.send(user, cb);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!thinking_prompt(o)) r.left_reasoning = true;  // no thinking section was opened
  return r;
}

std::string clip(const std::string& s, size_t n) { return s.size() <= n ? s : s.substr(0, n) + "..."; }

}  // namespace

TEST(K3NanoChat, HeldOutPromptsRenderAsTheFineTuneData) {
  const auto& m = nano_model();
  size_t n = 0;
  for (const char* f : {"questions.jsonl", "tool_prompts.jsonl"}) {
    for (const auto& rec : read_jsonl(fixtures() / f)) {
      const k3::ChatOptions o = options_of(rec);
      std::vector<k3::chat::Message> msgs;
      if (!o.system.empty()) msgs.push_back({"system", o.system, "", {}, "", ""});
      msgs.push_back({"user", rec["user"].get<std::string>(), "", {}, "", ""});
      const auto ids = k3::chat::segments_ids(m.tok, k3::chat::render(msgs, o.render));
      const std::vector<k3::tok::TokenId> want = rec["prompt_ids"].get<std::vector<k3::tok::TokenId>>();
      EXPECT_EQ(ids, want) << rec["id"];
      ++n;
    }
  }
  EXPECT_GE(n, 80u);
}

TEST(K3NanoChat, GreedyRepliesCloseThinkingAnswerAndCallTools) {
  const auto questions = read_jsonl(fixtures() / "questions.jsonl");
  const auto tool_prompts = read_jsonl(fixtures() / "tool_prompts.jsonl");
  ASSERT_EQ(questions.size(), 50u);
  ASSERT_GE(tool_prompts.size(), 30u);
  const auto t0 = std::chrono::steady_clock::now();
  json out_replies = json::array();
  int answered = 0, closed = 0, ended = 0, calls_ok = 0, strict_ok = 0, q_tokens = 0, t_tokens = 0;
  for (const auto& rec : questions) {
    const Reply r = run_prompt(rec);
    const auto& rep = r.turn.reply;
    const bool ans = r.left_reasoning && !trim(rep.content).empty();
    closed += r.left_reasoning;
    answered += ans;
    ended += r.turn.reason == k3::StopReason::EndToken;
    q_tokens += int(r.turn.stats.generated_tokens);
    std::printf("%s %3lld tok %-10s closed %d answer %d | %s\n", r.id.c_str(), (long long)r.turn.stats.generated_tokens,
                k3::stop_reason_name(r.turn.reason), int(r.left_reasoning), int(ans), clip(trim(rep.content), 90).c_str());
    out_replies.push_back({{"id", r.id}, {"kind", r.kind}, {"user", rec["user"]}, {"tokens", r.turn.stats.generated_tokens},
                           {"stop", k3::stop_reason_name(r.turn.reason)}, {"closed_thinking", r.left_reasoning},
                           {"answered", ans}, {"reasoning", rep.reasoning}, {"content", rep.content},
                           {"reference_answer", rec.value("reference_answer", "")}});
  }
  for (const auto& rec : tool_prompts) {
    const Reply r = run_prompt(rec);
    const auto& rep = r.turn.reply;
    std::string problem = rep.tool_calls.empty() ? "no tool call" : "";
    json calls = json::array();
    for (size_t k = 0; k < rep.tool_calls.size(); ++k) {
      const std::string p = call_problem(rep.tool_calls[k], int(k) < r.calls_closed, rec["tools"]);
      const std::string sp = p.empty() ? strict_problem(rep.tool_calls[k], rec["tools"]) : p;
      if (k == 0) {  // the first call decides
        problem = p;
        strict_ok += sp.empty();
      }
      calls.push_back({{"name", rep.tool_calls[k].name}, {"arguments", rep.tool_calls[k].arguments}, {"problem", p},
                       {"strict_problem", sp}});
    }
    calls_ok += problem.empty();
    t_tokens += int(r.turn.stats.generated_tokens);
    std::printf("%s %3lld tok %-10s call %s\n", r.id.c_str(), (long long)r.turn.stats.generated_tokens,
                k3::stop_reason_name(r.turn.reason),
                problem.empty() ? (rep.tool_calls[0].name + " " + rep.tool_calls[0].arguments.dump()).c_str()
                                : ("NOT WELL-FORMED: " + problem).c_str());
    out_replies.push_back({{"id", r.id}, {"kind", r.kind}, {"user", rec["user"]}, {"tokens", r.turn.stats.generated_tokens},
                           {"stop", k3::stop_reason_name(r.turn.reason)}, {"well_formed_call", problem.empty()},
                           {"problem", problem}, {"calls", calls}, {"reasoning", rep.reasoning}, {"content", rep.content}});
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int nq = int(questions.size()), nt = int(tool_prompts.size());
  std::printf("questions: %d/%d closed the thinking section, %d/%d closed it and answered (%d ended the message); "
              "%d tokens\ntool prompts: %d/%d well-formed tool calls (%d/%d also with declared argument names, types and "
              "enum values); %d tokens\n%.1f s\n",
              closed, nq, answered, nq, ended, q_tokens, calls_ok, nt, strict_ok, nt, t_tokens, secs);
  RecordProperty("answered", std::to_string(answered) + "/" + std::to_string(nq));
  RecordProperty("tool_calls_well_formed", std::to_string(calls_ok) + "/" + std::to_string(nt));
  if (const char* jp = std::getenv("K3_NANO_CHAT_JSON")) {
    json j = {{"questions", nq},
              {"closed_thinking", closed},
              {"closed_thinking_and_answered", answered},
              {"ended_message", ended},
              {"tool_prompts", nt},
              {"well_formed_tool_calls", calls_ok},
              {"well_formed_tool_calls_strict", strict_ok},
              {"generated_tokens", q_tokens + t_tokens},
              {"seconds", secs},
              {"max_tokens_per_reply", kMaxTokens},
              {"replies", out_replies}};
    std::ofstream(jp) << j.dump(1) << "\n";
  }
  EXPECT_GE(answered, int(kMinAnswered * nq + 0.999)) << "replies that closed thinking and answered";
  EXPECT_GE(calls_ok, int(kMinToolCalls * nt + 0.999)) << "well-formed tool calls";
}
