#include "services/numerics/shared_expert.h"

#include <vector>

#include "services/numerics/linear.h"
#include "services/numerics/situ.h"

namespace moe::numerics::ref {

using tensor::Bf16;

void SharedExpert(const Bf16* x, int64_t tokens, int64_t hidden, const Bf16* gate, const Bf16* up,
                  const Bf16* down, int64_t shared, float beta, float linear_beta, Bf16* out) {
  std::vector<Bf16> g(static_cast<size_t>(tokens * shared));
  std::vector<Bf16> u(static_cast<size_t>(tokens * shared));
  LinearBf16(x, tokens, hidden, gate, shared, g.data());
  LinearBf16(x, tokens, hidden, up, shared, u.data());
  std::vector<Bf16> h(static_cast<size_t>(tokens * shared));
  for (size_t i = 0; i < h.size(); ++i) {
    h[i] = Bf16::FromFloat(Situ(g[i].ToFloat(), u[i].ToFloat(), beta, linear_beta));
  }
  LinearBf16(h.data(), tokens, shared, down, hidden, out);
}

}  // namespace moe::numerics::ref
