#include "services/numerics/tolerance.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace moe::numerics {

using tensor::Bf16;

int UlpDistance(Bf16 a, Bf16 b) {
  auto ordered = [](uint16_t v) {
    return (v & 0x8000) ? -static_cast<int>(v & 0x7fff) : static_cast<int>(v & 0x7fff);
  };
  return std::abs(ordered(a.bits) - ordered(b.bits));
}

double Bf16UlpAt(double v) { return std::ldexp(1.0, std::ilogb(std::fabs(v)) - 7); }

void UlpStats::AddRows(const Bf16* got, const Bf16* want, int64_t rows, int64_t width,
                       const Bf16* scale_rows) {
  auto rms = [width](const Bf16* row) {
    double ss = 0;
    for (int64_t i = 0; i < width; ++i) ss += double(row[i].ToFloat()) * row[i].ToFloat();
    return std::sqrt(ss / static_cast<double>(width));
  };
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t base = row * width;
    const double scale =
        std::max(rms(want + base), scale_rows != nullptr ? rms(scale_rows + base) : 0.0);
    const double ulp = Bf16UlpAt(scale + 1e-30);
    for (int64_t i = 0; i < width; ++i) {
      const Bf16 a = got[base + i], b = want[base + i];
      const int u = UlpDistance(a, b);
      ++total;
      differing += u > 0;
      over1 += u > 1;
      max_ulp = std::max(max_ulp, u);
      const double row_ulps = std::fabs(double(a.ToFloat()) - b.ToFloat()) / ulp;
      // NaN in either side counts as out of bounds.
      if (!(row_ulps <= max_row_ulps)) {
        max_row_ulps = std::isnan(row_ulps) ? INFINITY : row_ulps;
        worst_index = base + i;
      }
    }
  }
}

bool UlpStats::Within(const Tolerance& t) const {
  if (total == 0) return true;
  const double n = static_cast<double>(total);
  return max_row_ulps <= t.max_row_ulps && over1 <= t.over1_fraction * n &&
         differing <= t.differing_fraction * n && (t.max_ulp < 0 || max_ulp <= t.max_ulp);
}

std::string UlpStats::Str() const {
  char buf[240];
  const double n = total > 0 ? static_cast<double>(total) : 1.0;
  std::snprintf(buf, sizeof(buf),
                "%lld of %lld differ (%.2e), %lld by more than 1 ulp (%.2e), max %d ulp, "
                "max %.2f ulp of the row scale",
                static_cast<long long>(differing), static_cast<long long>(total),
                static_cast<double>(differing) / n, static_cast<long long>(over1),
                static_cast<double>(over1) / n, max_ulp, max_row_ulps);
  return buf;
}

}  // namespace moe::numerics
