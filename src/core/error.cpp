// Error helpers (see error.h).
#include "core/error.h"

#include <algorithm>

namespace k3 {

void fail(const std::string& msg) { throw Error(msg); }

void ProblemList::throw_if_any(const std::string& what) const {
  if (problems_.empty()) return;
  std::string msg = what;
  msg.append(": ")
      .append(std::to_string(problems_.size()))
      .append(problems_.size() == 1 ? " problem: " : " problems: ");
  // The first kMaxListed only: a checkpoint or config with hundreds of problems stays one readable line.
  constexpr size_t kMaxListed = 8;
  const size_t listed = std::min(problems_.size(), kMaxListed);
  for (size_t i = 0; i < listed; ++i) {
    if (i) msg += "; ";
    msg += problems_[i];
  }
  if (problems_.size() > listed) msg += "; and " + std::to_string(problems_.size() - listed) + " more";
  throw Error(msg);
}

}  // namespace k3
