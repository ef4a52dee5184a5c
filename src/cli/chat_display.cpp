// Reply display for `k3 chat` (see chat_display.h).
#include "cli/chat_display.h"

namespace k3::cli {

void Display::on_event(const chat::Event& e) {
  switch (e.kind) {
    case chat::EventKind::Reasoning:
      section(Section::Reasoning, "[thinking] ");
      out(e.text);
      break;
    case chat::EventKind::Content:
      section(Section::Content, "[answer] ");
      out(e.text);
      break;
    case chat::EventKind::ToolCallStart:
      section(Section::Tool, "");
      out(std::string(at_line_start_ ? "" : "\n") + (color_ ? "\x1b[1m" : "") + "[tool call] " + e.text +
          (color_ ? "\x1b[0m" : "") + " ");
      break;
    case chat::EventKind::ToolArgs:
      out(e.text);
      break;
    case chat::EventKind::ToolCallEnd:
      out("\n");
      break;
  }
}

void Display::end_reply() {
  if (color_ && section_ == Section::Reasoning) std::fputs("\x1b[0m", f_);
  if (!at_line_start_) out("\n");
  section_ = Section::None;
  std::fflush(f_);
}

void Display::section(Section s, const char* label) {
  if (section_ == s) return;
  if (color_ && section_ == Section::Reasoning) std::fputs("\x1b[0m", f_);
  if (!at_line_start_) out("\n");
  section_ = s;
  if (color_ && s == Section::Reasoning) std::fputs("\x1b[2m", f_);
  out(label);
}

void Display::out(const std::string& t) {
  if (t.empty()) return;
  std::fwrite(t.data(), 1, t.size(), f_);
  std::fflush(f_);
  at_line_start_ = t.back() == '\n';
}

}  // namespace k3::cli
