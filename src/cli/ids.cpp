// See ids.h.
#include "cli/ids.h"

#include <cctype>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace k3::cli {

std::vector<int32_t> parse_ids(const std::string& arg) {
  std::string text = arg, where = "--ids";
  if (!arg.empty() && arg[0] == '@') {
    const std::string path = arg.substr(1);
    std::ifstream f(path);
    if (!f) fail("cannot read ids file " + path);
    std::stringstream ss;
    ss << f.rdbuf();
    text = ss.str();
    where = path;
  }
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < text.size()) {
    const unsigned char ch = static_cast<unsigned char>(text[i]);
    if (ch == ',' || std::isspace(ch)) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < text.size() && std::isdigit(static_cast<unsigned char>(text[j]))) ++j;
    const bool bad_end = j < text.size() && text[j] != ',' && !std::isspace(static_cast<unsigned char>(text[j]));
    if (j == i || bad_end || j - i > 9) {
      size_t e = i;
      while (e < text.size() && text[e] != ',' && !std::isspace(static_cast<unsigned char>(text[e]))) ++e;
      fail(where + ": '" + text.substr(i, e - i) + "' is not a token id (expected non-negative integers)");
    }
    ids.push_back(int32_t(std::stol(text.substr(i, j - i))));
    i = j;
  }
  if (ids.empty()) fail(where + ": no token ids given");
  return ids;
}

}  // namespace k3::cli
