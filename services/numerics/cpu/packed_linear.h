// A dense bf16 projection prepared for the CPU kernels: the [out, in] Linear weight repacked
// once into 128-column tiles (kernels.h), applied with fp32 accumulation in the reference's
// order, so the result equals ref::LinearF32 bit for bit on every ISA and thread count.
//
//   PackedLinear down = PackedLinear::Pack(w.down_proj.data(), latent, hidden);
//   down.Apply(kernels, &pool, x_f32, tokens, z_f32);  // z: [tokens, down.padded_out()]
#ifndef MOE_SERVICES_NUMERICS_CPU_PACKED_LINEAR_H_
#define MOE_SERVICES_NUMERICS_CPU_PACKED_LINEAR_H_

#include <cstdint>
#include <vector>

#include "services/common/thread_pool.h"
#include "services/numerics/cpu/kernels.h"
#include "services/tensor/bf16.h"

namespace moe::numerics::cpu {

class PackedLinear {
 public:
  PackedLinear() = default;
  // w: [out, in] bf16.
  static PackedLinear Pack(const tensor::Bf16* w, int64_t out, int64_t in);

  int64_t in() const { return in_; }
  int64_t out() const { return out_; }
  int64_t padded_out() const { return padded_out_; }
  size_t bytes() const { return tiles_.size() * sizeof(uint16_t); }

  // x: [tokens, in] fp32 -> y: [tokens, padded_out()] fp32. Work items: column tiles x token
  // blocks.
  void Apply(const KernelTable& k, ThreadPool* pool, const float* x, int64_t tokens,
             float* y) const;

 private:
  int64_t in_ = 0, out_ = 0, padded_out_ = 0;
  std::vector<uint16_t> tiles_;
};

}  // namespace moe::numerics::cpu

#endif  // MOE_SERVICES_NUMERICS_CPU_PACKED_LINEAR_H_
