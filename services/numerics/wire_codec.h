// The little binary codec of the statistics that attention nodes send router-svc (QB's
// histograms, qb.h; dynamic k's budget histograms, dynamic_k.h): LEB128 varints, fixed-width
// little-endian values, and a bounds-checked reader. Header-only, for those two files.
//
//   std::string out; PutFixed<uint32_t>(n, &out); PutVarint(count, &out);
//   WireReader r(bytes); uint32_t n; uint64_t c; if (!r.Fixed(&n) || !r.Varint(&c)) ...;
#ifndef MOE_SERVICES_NUMERICS_WIRE_CODEC_H_
#define MOE_SERVICES_NUMERICS_WIRE_CODEC_H_

#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/string_view.h"

namespace moe::numerics {

inline void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

template <typename T>
void PutFixed(T v, std::string* out) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
  out->append(b, sizeof(T));
}

class WireReader {
 public:
  explicit WireReader(absl::string_view b) : b_(b) {}
  // False at the end of the input or on a varint longer than 64 bits.
  bool Varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= b_.size()) return false;
      const uint8_t c = static_cast<uint8_t>(b_[pos_++]);
      *v |= static_cast<uint64_t>(c & 0x7f) << shift;
      if ((c & 0x80) == 0) return true;
    }
    return false;
  }
  template <typename T>
  bool Fixed(T* v) {
    if (b_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool AtEnd() const { return pos_ == b_.size(); }

 private:
  absl::string_view b_;
  size_t pos_ = 0;
};

}  // namespace moe::numerics

#endif  // MOE_SERVICES_NUMERICS_WIRE_CODEC_H_
