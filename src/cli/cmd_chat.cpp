// `k3 chat`: interactive multi-turn chat in the checkpoint's chat format (K3 XTML, or Kimi K2 for Kimi
// Linear; --chat-format overrides). Reasoning is shown apart from the
// answer, tool calls as structured lines; /reset, /save, /load, /tool, /stats, /help, /exit.
// Owns the terminal loop and display; turns, state and files live in runtime/chat_session.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/chat_display.h"
#include "cli/cli_common.h"
#include "cli/cmd_run.h"
#include "cli/line_editor.h"
#include "cli/utf8.h"
#include "core/error.h"
#include "runtime/chat_session.h"

namespace k3::cli {

namespace {

const char* kHelp =
    "commands:\n"
    "  /reset          forget the conversation (keeps the system prompt)\n"
    "  /save FILE      save the conversation and its exact session state\n"
    "  /load FILE      restore a saved conversation\n"
    "  /tool TEXT      answer the oldest unanswered tool call of the last reply with TEXT\n"
    "  /stats          toggle a statistics line after each reply\n"
    "  /help           this text\n"
    "  /exit, /quit    leave (so does Ctrl-D; Ctrl-C stops a reply, or leaves at the prompt)\n"
    "  a line ending in \\ continues on the next line; start a message with // to send a literal /\n";

// Reads one logical line (a trailing backslash continues it). False on EOF or Ctrl-C. With an
// editor (a terminal), lines are read through libedit and each one typed goes into its history.
bool read_message(bool interactive, LineEditor* editor, std::string& msg) {
  msg.clear();
  std::string line;
  bool first = true;
  for (;;) {
    if (editor) {
      if (!editor->read_line(first ? "> " : "... ", line)) return false;
      editor->remember(line);
    } else {
      if (interactive) {
        std::fputs(first ? "> " : "... ", stdout);
        std::fflush(stdout);
      }
      if (!std::getline(std::cin, line)) return false;
    }
    first = false;
    if (!line.empty() && line.back() == '\\') {
      msg += line.substr(0, line.size() - 1) + "\n";
      continue;
    }
    msg += line;
    return true;
  }
}

// The command line of k3 chat.
struct ChatFlags {
  RunEngineFlags ef;
  SamplingFlags sf;
  std::string system, system_file, effort, tools_file, load_file, chat_format;
  int64_t max_tokens = 1024;
  bool no_color = false, show_stats = false;
};

void add_chat_flags(CLI::App& app, ChatFlags& f) {
  app.add_option("--system", f.system, "system prompt");
  app.add_option("--system-file", f.system_file, "read the system prompt from FILE");
  app.add_option("--reasoning-effort", f.effort,
                 "thinking effort message: low, medium, high, max, or none (no thinking); "
                 "default: no effort message (the model's default)")
      ->check(CLI::IsMember({"low", "medium", "high", "max", "none"}));
  app.add_option("--tools", f.tools_file, "JSON file with OpenAI-style tool declarations (an array)");
  app.add_option("-n,--max-tokens", f.max_tokens, "tokens per reply at most (default 1024)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 40));
  app.add_option("--load", f.load_file, "start from a conversation saved with /save");
  app.add_option("--chat-format", f.chat_format,
                 "chat format: xtml (K3) or k2 (Kimi K2 / Kimi Linear); default: the checkpoint's (its chat "
                 "template, else its model_type)")
      ->check(CLI::IsMember({"xtml", "k2"}));
  app.add_flag("--no-color", f.no_color, "no terminal colours");
  app.add_flag("--stats", f.show_stats, "print a statistics line after each reply");
  f.ef.add(&app);
  f.sf.add(&app);
  // --ctx comes from the engine flags; a chat grows, so its default is bounded.
  app.get_option("--ctx")->description(
      "context limit in tokens (default: min(max_position_embeddings, 32768), which keeps the MLA cache within "
      "laptop memory)");
}

// The rendering options of the flags: system prompt, reasoning effort, tool declarations.
ChatOptions chat_options(const ChatFlags& f) {
  std::string system = f.system;
  if (!f.system.empty() && !f.system_file.empty()) fail("give --system or --system-file, not both");
  if (!f.system_file.empty()) {
    std::ifstream in(f.system_file, std::ios::binary);
    if (!in) fail("cannot read " + f.system_file);
    system.assign(std::istreambuf_iterator<char>(in), {});
    require_utf8(system, "the system prompt in " + f.system_file);
  } else {
    require_utf8(system, "the --system prompt");
  }
  ChatOptions co;
  co.system = system;
  if (!f.effort.empty()) {
    co.render.thinking_effort = f.effort;
    co.render.thinking = f.effort != "none";
  }
  if (!f.tools_file.empty()) {
    std::ifstream in(f.tools_file);
    if (!in) fail("cannot read " + f.tools_file);
    co.render.tools = nlohmann::json::parse(in, nullptr, false);
    if (co.render.tools.is_discarded() || !co.render.tools.is_array())
      fail(f.tools_file + ": tool declarations must be a JSON array");
  }
  return co;
}

// The oldest call of the last assistant reply that no later tool message answers ("" if none).
std::string unanswered_tool_call(const ChatSession& chat) {
  const auto& ms = chat.messages();
  for (size_t i = ms.size(); i-- > 0;) {
    if (ms[i].role != "assistant") continue;
    for (const auto& c : ms[i].tool_calls) {
      bool answered = false;
      for (size_t k = i + 1; k < ms.size(); ++k) answered |= ms[k].tool_call_id == c.id;
      if (!answered) return c.id;
    }
    break;
  }
  return "";
}

// What an input line asks for: a message to send (filled in), a command already run, or leaving.
enum class LineAction { Send, Done, Quit };

// A slash command: runs it, or (/tool) fills in the tool message to send.
LineAction run_command(const std::string& line, ChatSession& chat, bool& show_stats, chat::Message& msg) {
  std::istringstream cmd(line);
  std::string name, arg;
  cmd >> name;
  std::getline(cmd >> std::ws, arg);
  if (name == "/exit" || name == "/quit") return LineAction::Quit;
  if (name == "/help") {
    std::fputs(kHelp, stdout);
  } else if (name == "/reset") {
    chat.reset();
    std::puts("[conversation reset]");
  } else if (name == "/stats") {
    show_stats = !show_stats;
    std::printf("[stats %s]\n", show_stats ? "on" : "off");
  } else if (name == "/save" || name == "/load") {
    if (arg.empty()) fail(name + " needs a file name");
    if (name == "/save")
      chat.save(arg);
    else
      chat.load(arg);
    std::printf("[%s %s: %zu messages, %zu tokens]\n", name == "/save" ? "saved to" : "loaded", arg.c_str(),
                chat.messages().size(), chat.transcript().size());
  } else if (name == "/tool") {
    const std::string call_id = unanswered_tool_call(chat);
    if (call_id.empty()) fail("/tool: the last reply has no unanswered tool call");
    msg.role = "tool";
    msg.tool_call_id = call_id;
    msg.content = arg;
    return LineAction::Send;
  } else {
    fail("unknown command " + name + " (try /help)");
  }
  return LineAction::Done;
}

// A line: "//..." sends a literal "/...", "/..." is a command, an empty line is skipped.
LineAction interpret_line(const std::string& line, ChatSession& chat, bool& show_stats, chat::Message& msg) {
  require_utf8(line, "the message");
  if (line.rfind("//", 0) == 0) {
    msg.role = "user";
    msg.content = line.substr(1);
    return LineAction::Send;
  }
  if (!line.empty() && line[0] == '/') return run_command(line, chat, show_stats, msg);
  if (line.empty()) return LineAction::Done;
  msg.role = "user";
  msg.content = line;
  return LineAction::Send;
}

struct ChatTotals {
  GenStats total;
  StopReason last = StopReason::EndToken;
};

// Sends one message, shows the reply as it streams, and adds up its statistics.
void send_turn(ChatSession& chat, const chat::Message& msg, bool color, bool show_stats, ChatTotals& t) {
  Display display(color);
  TurnCallbacks cb;
  cb.on_event = [&](const chat::Event& e) { display.on_event(e); };
  const TurnResult r = chat.send(msg, cb, &interrupt_flag());
  display.end_reply();
  t.total.prompt_tokens += r.stats.prompt_tokens;
  t.total.generated_tokens += r.stats.generated_tokens;
  t.total.prefill_seconds += r.stats.prefill_seconds;
  t.total.decode_seconds += r.stats.decode_seconds;
  t.last = r.reason;
  if (r.reason == StopReason::Interrupted)
    std::puts("[interrupted]");
  else if (r.reason == StopReason::MaxTokens)
    std::puts("[reply cut at --max-tokens]");
  else if (r.reason == StopReason::ContextFull)
    std::puts("[context full: /reset to start over]");
  if (show_stats)
    std::fprintf(stderr, "[%s | new prompt %lld tok%s]\n", summary_line(r.stats, r.reason).c_str(),
                 (long long)r.prefilled, r.resynced ? " | reply re-tokenized" : "");
}

// Reads and answers lines until EOF, Ctrl-C at the prompt or /exit. Interactive: an error is
// printed and the chat goes on; from a script it ends the command.
void chat_loop(ChatSession& chat, bool interactive, bool color, bool& show_stats, ChatTotals& t) {
  std::string line;
  // Line editing and history only when a person types at a terminal and sees the echo there.
  std::unique_ptr<LineEditor> editor;
  if (interactive && stdout_is_tty()) editor = std::make_unique<LineEditor>();
  for (;;) {
    interrupt_flag().store(false);
    if (!read_message(interactive, editor.get(), line)) {
      if (interactive) std::fputs("\n", stdout);
      break;  // EOF or Ctrl-C at the prompt
    }
    try {
      chat::Message msg;
      const LineAction a = interpret_line(line, chat, show_stats, msg);
      if (a == LineAction::Quit) break;
      if (a == LineAction::Send) send_turn(chat, msg, color, show_stats, t);
    } catch (const Error& e) {
      if (!interactive) throw;  // scripts fail fast
      print_error("k3 chat", e.what());
    }
  }
}

// Setup (options, model, session), the loop, and the summary line.
int run_chat(ChatFlags& f, bool interactive) {
  ChatOptions co = chat_options(f);
  const std::string dir = resolve_model_dir(f.ef.model);
  const ModelConfig cfg = load_model_config(dir);
  // A chat grows; the default context keeps the MLA cache within laptop memory.
  const int64_t ctx = f.ef.ctx ? f.ef.ctx : std::min<int64_t>(cfg.max_position_embeddings, 32768);
  std::string sampling_source;
  co.sampling = f.sf.resolve(dir, &sampling_source);
  co.max_tokens = f.max_tokens;
  co.max_context = ctx;
  co.ubatch = f.ef.ubatch;
  co.format = f.chat_format.empty() ? chat::detect_format(f.ef.tokenizer.empty() ? dir : f.ef.tokenizer, cfg.model_type)
                                    : chat::parse_format_name(f.chat_format);
  RunEngineFlags f2 = f.ef;
  f2.model = dir;
  LoadedModel lm = load_for_generation(f2, "k3 chat", ctx);
  co.forward = lm.forward(f.ef);
  ChatSession chat(*lm.model, *lm.tok, co);
  if (!f.load_file.empty()) chat.load(f.load_file);

  if (interrupt_flag().load()) {
    std::fprintf(stderr, "k3 chat: interrupted while loading\n");
    return 130;
  }
  const bool color = !f.no_color && stdout_is_tty();
  if (interactive)
    std::fprintf(stderr,
                 "k3 chat: %s, %s chat format, context %lld tokens, seed %llu. /help for commands, Ctrl-D to leave.\n",
                 dir.c_str(), chat::format_name(co.format).c_str(), (long long)ctx, (unsigned long long)co.sampling.seed);
  ChatTotals t;
  chat_loop(chat, interactive, color, f.show_stats, t);
  std::fprintf(stderr, "k3 chat: %s%s\n", summary_line(t.total, t.last).c_str(),
               expert_summary(lm, {}, t.total.prompt_tokens + t.total.generated_tokens, -1).c_str());
  return 0;
}

}  // namespace

int cmd_chat(int argc, char** argv) {
  CLI::App app{"k3 chat: interactive multi-turn chat in the checkpoint's chat format (type /help inside)"};
  app.name("k3 chat");
  ChatFlags f;
  add_chat_flags(app, f);
  if (const auto code = parse_flags(app, argc, argv)) return *code;
  const bool interactive = ::isatty(0) == 1;
  install_interrupt_handler();
  return run_guarded("k3 chat", [&]() -> int { return run_chat(f, interactive); });
}

}  // namespace k3::cli
