// `k3 chat`: interactive multi-turn chat in the K3 XTML format. Reasoning is shown apart from the
// answer, tool calls as structured lines; /reset, /save, /load, /tool, /stats, /help, /exit.
// Owns the terminal loop and display; turns, state and files live in runtime/chat_session.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/chat_display.h"
#include "cli/cli_common.h"
#include "cli/cmd_run.h"
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

// Reads one logical line (a trailing backslash continues it). False on EOF or Ctrl-C.
bool read_message(bool interactive, std::string& msg) {
  msg.clear();
  std::string line;
  bool first = true;
  for (;;) {
    if (interactive) {
      std::fputs(first ? "> " : "... ", stdout);
      std::fflush(stdout);
    }
    if (!std::getline(std::cin, line)) return false;
    first = false;
    if (!line.empty() && line.back() == '\\') {
      msg += line.substr(0, line.size() - 1) + "\n";
      continue;
    }
    msg += line;
    return true;
  }
}

}  // namespace

int cmd_chat(int argc, char** argv) {
  CLI::App app{"k3 chat: interactive multi-turn chat in the K3 chat format (type /help inside)"};
  app.name("k3 chat");
  RunEngineFlags ef;
  SamplingFlags sf;
  std::string system, system_file, effort, tools_file, load_file;
  int64_t max_tokens = 1024;
  bool no_color = false, show_stats = false;
  app.add_option("--system", system, "system prompt");
  app.add_option("--system-file", system_file, "read the system prompt from FILE");
  app.add_option("--reasoning-effort", effort, "thinking effort message: low, medium, high, max, or none (no thinking); "
                                               "default: no effort message (the model's default)")
      ->check(CLI::IsMember({"low", "medium", "high", "max", "none"}));
  app.add_option("--tools", tools_file, "JSON file with OpenAI-style tool declarations (an array)");
  app.add_option("-n,--max-tokens", max_tokens, "tokens per reply at most (default 1024)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 40));
  app.add_option("--load", load_file, "start from a conversation saved with /save");
  app.add_flag("--no-color", no_color, "no terminal colours");
  app.add_flag("--stats", show_stats, "print a statistics line after each reply");
  ef.add(&app);
  sf.add(&app);
  if (const auto code = parse_flags(app, argc, argv)) return *code;
  const bool interactive = ::isatty(0) == 1;
  install_interrupt_handler();
  return run_guarded("k3 chat", [&]() -> int {
    if (!system.empty() && !system_file.empty()) fail("give --system or --system-file, not both");
    if (!system_file.empty()) {
      std::ifstream f(system_file, std::ios::binary);
      if (!f) fail("cannot read " + system_file);
      system.assign(std::istreambuf_iterator<char>(f), {});
    }
    ChatOptions co;
    co.system = system;
    if (!effort.empty()) {
      co.render.thinking_effort = effort;
      co.render.thinking = effort != "none";
    }
    if (!tools_file.empty()) {
      std::ifstream f(tools_file);
      if (!f) fail("cannot read " + tools_file);
      co.render.tools = nlohmann::json::parse(f, nullptr, false);
      if (co.render.tools.is_discarded() || !co.render.tools.is_array())
        fail(tools_file + ": tool declarations must be a JSON array");
    }
    const std::string dir = resolve_model_dir(ef.model);
    const ModelConfig cfg = load_model_config(dir);
    // A chat grows; the default context keeps the MLA cache within laptop memory.
    const int64_t ctx = ef.ctx ? ef.ctx : std::min<int64_t>(cfg.max_position_embeddings, 32768);
    std::string sampling_source;
    co.sampling = sf.resolve(dir, &sampling_source);
    co.max_tokens = max_tokens;
    co.max_context = ctx;
    co.ubatch = ef.ubatch;
    RunEngineFlags f2 = ef;
    f2.model = dir;
    LoadedModel lm = load_for_generation(f2, "k3 chat", ctx);
    co.forward = lm.forward(ef);
    ChatSession chat(*lm.model, *lm.tok, co);
    if (!load_file.empty()) chat.load(load_file);

    if (interrupt_flag().load()) {
      std::fprintf(stderr, "k3 chat: interrupted while loading\n");
      return 130;
    }
    const bool color = !no_color && stdout_is_tty();
    if (interactive)
      std::fprintf(stderr, "k3 chat: %s, context %lld tokens, seed %llu. /help for commands, Ctrl-D to leave.\n",
                   dir.c_str(), (long long)ctx, (unsigned long long)co.sampling.seed);
    GenStats total;
    StopReason last = StopReason::EndToken;
    std::string line;
    for (;;) {
      interrupt_flag().store(false);
      if (!read_message(interactive, line)) {
        if (interactive) std::fputs("\n", stdout);
        break;  // EOF or Ctrl-C at the prompt
      }
      try {
        chat::Message msg;
        if (line.rfind("//", 0) == 0) {
          msg.role = "user";
          msg.content = line.substr(1);
        } else if (!line.empty() && line[0] == '/') {
          std::istringstream cmd(line);
          std::string name, arg;
          cmd >> name;
          std::getline(cmd >> std::ws, arg);
          if (name == "/exit" || name == "/quit") break;
          if (name == "/help") {
            std::fputs(kHelp, stdout);
            continue;
          }
          if (name == "/reset") {
            chat.reset();
            std::puts("[conversation reset]");
            continue;
          }
          if (name == "/stats") {
            show_stats = !show_stats;
            std::printf("[stats %s]\n", show_stats ? "on" : "off");
            continue;
          }
          if (name == "/save" || name == "/load") {
            if (arg.empty()) fail(name + " needs a file name");
            if (name == "/save") chat.save(arg);
            else chat.load(arg);
            std::printf("[%s %s: %zu messages, %zu tokens]\n", name == "/save" ? "saved to" : "loaded", arg.c_str(),
                        chat.messages().size(), chat.transcript().size());
            continue;
          }
          if (name == "/tool") {
            // The oldest call of the last assistant reply that no later tool message answers.
            const auto& ms = chat.messages();
            std::string call_id;
            for (size_t i = ms.size(); i-- > 0 && call_id.empty();) {
              if (ms[i].role != "assistant") continue;
              for (const auto& c : ms[i].tool_calls) {
                bool answered = false;
                for (size_t k = i + 1; k < ms.size(); ++k) answered |= ms[k].tool_call_id == c.id;
                if (!answered) {
                  call_id = c.id;
                  break;
                }
              }
              break;
            }
            if (call_id.empty()) fail("/tool: the last reply has no unanswered tool call");
            msg.role = "tool";
            msg.tool_call_id = call_id;
            msg.content = arg;
          } else {
            fail("unknown command " + name + " (try /help)");
          }
        } else {
          if (line.empty()) continue;
          msg.role = "user";
          msg.content = line;
        }
        Display display(color);
        TurnCallbacks cb;
        cb.on_event = [&](const chat::Event& e) { display.on_event(e); };
        const TurnResult r = chat.send(msg, cb, &interrupt_flag());
        display.end_reply();
        total.prompt_tokens += r.stats.prompt_tokens;
        total.generated_tokens += r.stats.generated_tokens;
        total.prefill_seconds += r.stats.prefill_seconds;
        total.decode_seconds += r.stats.decode_seconds;
        last = r.reason;
        if (r.reason == StopReason::Interrupted) std::puts("[interrupted]");
        else if (r.reason == StopReason::MaxTokens) std::puts("[reply cut at --max-tokens]");
        else if (r.reason == StopReason::ContextFull) std::puts("[context full: /reset to start over]");
        if (show_stats)
          std::fprintf(stderr, "[%s | new prompt %lld tok%s]\n", summary_line(r.stats, r.reason).c_str(),
                       (long long)r.prefilled, r.resynced ? " | reply re-tokenized" : "");
      } catch (const Error& e) {
        if (!interactive) throw;  // scripts fail fast
        std::fprintf(stderr, "k3 chat: error: %s\n", e.what());
      }
    }
    std::fprintf(stderr, "k3 chat: %s%s\n", summary_line(total, last).c_str(),
                 expert_summary(lm, {}, total.prompt_tokens + total.generated_tokens, -1).c_str());
    return 0;
  });
}

}  // namespace k3::cli
