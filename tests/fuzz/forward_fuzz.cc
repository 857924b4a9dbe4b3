// libFuzzer target: attention-svc's ForwardRequest input path on any bytes: the request parses
// or not; its hidden states decode (bf16 or fp32, transport/tensor_codec.h) into exactly
// rows x width values or are refused with a message; nothing crashes or over-allocates.
#include <cstddef>
#include <cstdint>

#include "moe/v1/attention.pb.h"
#include "services/transport/tensor_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  moe::v1::ForwardRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  constexpr int64_t kWidth = 16;
  auto x = moe::transport::DecodeBf16Matrix(req.hidden_states(), "hidden_states", kWidth,
                                            /*accept_f32=*/true);
  if (!x.ok()) {
    if (x.status().message().empty()) __builtin_trap();  // every refusal says why
    return 0;
  }
  if (x->cols != kWidth || x->rows < 1) __builtin_trap();
  if (static_cast<int64_t>(x->values.size()) != x->rows * kWidth) __builtin_trap();
  const size_t elem = req.hidden_states().dtype() == moe::v1::DTYPE_F32 ? 4 : 2;
  if (req.hidden_states().data().size() != x->values.size() * elem) __builtin_trap();
  return 0;
}
