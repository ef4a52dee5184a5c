// How `k3 chat` shows a reply: a "[thinking]" section (dim on a terminal), an "[answer]" section,
// and one "[tool call] NAME ARGS" line per call, written to a FILE* as events stream in.
// Owns presentation only; parsing is chat::OutputParser's.
#pragma once
#include <cstdio>
#include <string>

#include "chat/chat.h"

namespace k3::cli {

class Display {
 public:
  explicit Display(bool color, std::FILE* out = stdout) : color_(color), f_(out) {}
  void on_event(const chat::Event& e);
  void end_reply();

 private:
  enum class Section { None, Reasoning, Content, Tool };
  void section(Section s, const char* label);
  void out(const std::string& t);
  bool color_;
  std::FILE* f_;
  Section section_ = Section::None;
  bool at_line_start_ = true;
};

}  // namespace k3::cli
