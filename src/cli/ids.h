// Parsing of token-id lists given on the command line: "1,2,3" or "@file" (commas/whitespace).
// Must not: accept anything but non-negative decimal integers (range vs vocab is checked later).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace k3::cli {
std::vector<int32_t> parse_ids(const std::string& arg);
}
