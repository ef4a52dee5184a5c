// Feeding a chat output parser (either format) in pieces, as tests do: every event of feed() for
// each part and of finish(), coalesced (streaming and one-shot then compare equal).
// Owns: nothing the engine uses; test-only.
#pragma once
#include <string>
#include <vector>

#include "chat/chat.h"

namespace k3test {

inline std::vector<k3::chat::Event> feed_all(k3::chat::StreamParser& p, const std::vector<std::string>& parts) {
  std::vector<k3::chat::Event> ev;
  for (const auto& s : parts) {
    auto e = p.feed(s);
    ev.insert(ev.end(), e.begin(), e.end());
  }
  auto tail = p.finish();
  ev.insert(ev.end(), tail.begin(), tail.end());
  return k3::chat::coalesce(ev);
}

}  // namespace k3test
