// Server-sent events framing (text/event-stream) for the streaming endpoints: data events, the
// final [DONE], comments used as keep-alives. Owns the byte format only; must not know JSON schemas.
#pragma once
#include <string>
#include <string_view>

namespace k3::server {

// "data: <line>\n" for each line of payload, then a blank line (a payload with line breaks stays one
// event).
std::string sse_data(std::string_view payload);
inline std::string sse_done() { return "data: [DONE]\n\n"; }
// ": <text>\n\n" (ignored by clients; keeps idle connections open and probes for a gone client).
std::string sse_comment(std::string_view text);

}  // namespace k3::server
