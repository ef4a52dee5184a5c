// See line_editor.h.
#include "cli/line_editor.h"

#include <histedit.h>
#include <langinfo.h>

#include <clocale>
#include <cstdio>
#include <cstring>

#include "cli/cli_common.h"

namespace k3::cli {

namespace {

char* prompt_of(EditLine* el) {
  void* data = nullptr;
  el_get(el, EL_CLIENTDATA, &data);
  return const_cast<char*>(static_cast<LineEditor*>(data)->prompt().c_str());
}

// libedit decodes what is typed with the C library's multibyte functions: chat text is UTF-8, so
// the character type follows the environment when that is UTF-8, else C.UTF-8.
void use_utf8_ctype() {
  if (std::setlocale(LC_CTYPE, "") && std::strcmp(nl_langinfo(CODESET), "UTF-8") == 0) return;
  if (!std::setlocale(LC_CTYPE, "C.UTF-8")) std::setlocale(LC_CTYPE, "C");
}

}  // namespace

LineEditor::LineEditor() {
  use_utf8_ctype();
  el_ = el_init("k3", stdin, stdout, stderr);
  hist_ = history_init();
  if (!el_ || !hist_) return;  // read_line falls back to plain reads
  HistEvent ev;
  history(hist_, &ev, H_SETSIZE, 1000);
  history(hist_, &ev, H_SETUNIQUE, 1);
  el_set(el_, EL_CLIENTDATA, static_cast<void*>(this));
  el_set(el_, EL_PROMPT, &prompt_of);
  el_set(el_, EL_EDITOR, "emacs");
  el_set(el_, EL_HIST, history, hist_);
  el_source(el_, nullptr);  // ~/.editrc, as other libedit programs
}

LineEditor::~LineEditor() {
  if (el_) el_end(el_);
  if (hist_) history_end(hist_);
}

bool LineEditor::read_line(const std::string& prompt, std::string& line) {
  line.clear();
  if (!el_ || !hist_) {
    std::fputs(prompt.c_str(), stdout);
    std::fflush(stdout);
    char buf[4096];
    bool got = false;
    while (std::fgets(buf, sizeof buf, stdin)) {
      got = true;
      line += buf;
      if (!line.empty() && line.back() == '\n') break;
    }
    if (!line.empty() && line.back() == '\n') line.pop_back();
    return got && !interrupt_flag().load();
  }
  prompt_ = prompt;
  std::fflush(stdout);
  int count = 0;
  // Ctrl-C: the k3 SIGINT handler (no SA_RESTART) interrupts the read, and el_gets returns early.
  const char* s = el_gets(el_, &count);
  if (interrupt_flag().load()) return false;
  if (!s || count <= 0) return false;  // end of input or a read error
  line.assign(s, size_t(count));
  if (!line.empty() && line.back() == '\n') line.pop_back();
  return true;
}

void LineEditor::remember(const std::string& line) {
  if (!hist_ || line.empty()) return;
  HistEvent ev;
  history(hist_, &ev, H_ENTER, line.c_str());
}

}  // namespace k3::cli
