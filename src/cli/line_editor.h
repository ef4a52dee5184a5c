// Line editing and history at the `k3 chat` prompt through libedit (BSD licence; el_gets with
// emacs key bindings, ~/.editrc honoured). Used only when stdin and stdout are terminals; piped
// input keeps plain std::getline. History lives in memory for the session.
// Owns: the EditLine / History handles. Must not: print anything but the prompt and the echo.
#pragma once
#include <string>

struct editline;
struct history;

namespace k3::cli {

class LineEditor {
 public:
  LineEditor();
  ~LineEditor();
  LineEditor(const LineEditor&) = delete;
  LineEditor& operator=(const LineEditor&) = delete;

  // Reads one line (without its newline) after showing `prompt`. False on end of input (Ctrl-D on
  // an empty line), on a read error, and when a Ctrl-C interrupted the read (interrupt_flag() set).
  bool read_line(const std::string& prompt, std::string& line);
  // Adds a non-empty line to the history (Up / Down, Ctrl-R).
  void remember(const std::string& line);

  const std::string& prompt() const { return prompt_; }

 private:
  editline* el_ = nullptr;
  history* hist_ = nullptr;
  std::string prompt_;
};

}  // namespace k3::cli
