// libFuzzer entry for the safetensors header parser (built only with clang: see CMakeLists.txt).
// Owns: feeding arbitrary bytes to parse_safetensors_header and checking the views' bounds.
// Must not: accept any exception other than k3::Error (anything else aborts the fuzzer).
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "core/error.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto h = k3::io::parse_safetensors_header(data, size, size, "fuzz");
    for (size_t i = 0; i < h.tensors.size(); ++i) {
      if (h.data_start > size || h.offsets[i] > size - h.data_start ||
          h.tensors[i].nbytes > size - h.data_start - h.offsets[i])
        std::abort();
    }
  } catch (const k3::Error&) {
  }
  return 0;
}
