// SSE framing (see sse.h). Line breaks: \n, \r\n and \r all end a line, as the SSE grammar says.
#include "server/sse.h"

namespace k3::server {

std::string sse_data(std::string_view payload) {
  std::string out;
  out.reserve(payload.size() + 16);
  size_t i = 0;
  for (;;) {
    size_t j = i;
    while (j < payload.size() && payload[j] != '\n' && payload[j] != '\r') ++j;
    out += "data: ";
    out.append(payload.substr(i, j - i));
    out += '\n';
    if (j >= payload.size()) break;
    i = j + (payload[j] == '\r' && j + 1 < payload.size() && payload[j + 1] == '\n' ? 2 : 1);
  }
  out += '\n';
  return out;
}

std::string sse_comment(std::string_view text) {
  std::string out = ": ";
  for (char c : text) out += (c == '\n' || c == '\r') ? ' ' : c;
  out += "\n\n";
  return out;
}

}  // namespace k3::server
