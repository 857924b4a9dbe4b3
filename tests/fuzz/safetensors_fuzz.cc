// libFuzzer target: the safetensors header parser must reject or accept any byte string
// without crashing, and every range it accepts must lie inside the input.
//   scripts/fuzz.sh            (builds with clang, ASan + UBSan, and runs a bounded session)
#include <cstddef>
#include <cstdint>
#include <string>

#include "services/checkpoint/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = moe::checkpoint::SafetensorsFile::FromBytes(
      std::string(reinterpret_cast<const char*>(data), size), "fuzz");
  if (!file.ok()) return 0;
  unsigned sum = 0;
  for (const auto& t : (*file)->tensors()) {
    if ((*file)->data_offset() + t.end > size) __builtin_trap();
    for (uint8_t b : (*file)->Data(t)) sum += b;
  }
  return static_cast<int>(sum & 0);
}
