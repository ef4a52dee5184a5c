// Error helpers (see error.h).
#include "core/error.h"

namespace k3 {

void fail(const std::string& msg) { throw Error(msg); }

void ProblemList::throw_if_any(const std::string& what) const {
  if (problems_.empty()) return;
  std::string msg = what;
  msg.append(": ")
      .append(std::to_string(problems_.size()))
      .append(problems_.size() == 1 ? " problem: " : " problems: ");
  for (size_t i = 0; i < problems_.size(); ++i) {
    if (i) msg += "; ";
    msg += problems_[i];
  }
  throw Error(msg);
}

}  // namespace k3
