// Names of weight formats (see weight.h).
#include "ops/weight.h"

namespace k3 {
const char* wformat_name(WFormat f) {
  switch (f) {
    case WFormat::F32:
      return "F32";
    case WFormat::F16:
      return "F16";
    case WFormat::BF16:
      return "BF16";
    case WFormat::MXFP4:
      return "MXFP4";
    case WFormat::FP8:
      return "FP8";
  }
  return "?";
}
}  // namespace k3
