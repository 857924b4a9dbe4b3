// One table per enum: each value's name, from which the enum is named, parsed and listed in a
// flag's help, so that a name and its parser never drift apart.
//
//   inline constexpr EnumNames<ReplyMode, 2> kReplyModes{
//       "reply mode", {{{ReplyMode::kPerPair, "per_pair"}, {ReplyMode::kPartialSum,
//       "partial_sum"}}}};
//   kReplyModes.Name(ReplyMode::kPerPair);   // "per_pair"
//   kReplyModes.Parse("partial_sum");        // ReplyMode::kPartialSum, or INVALID_ARGUMENT
//   kReplyModes.Choices();                   // "per_pair|partial_sum" (flags.Enum's help)
#ifndef MOE_SERVICES_COMMON_ENUM_NAMES_H_
#define MOE_SERVICES_COMMON_ENUM_NAMES_H_

#include <array>
#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace moe {

template <typename E>
struct EnumEntry {
  E value;
  const char* name;
};

template <typename E, size_t N>
struct EnumNames {
  const char* what;  // the parse error's subject: "reply mode"
  std::array<EnumEntry<E>, N> entries;

  // Every value of the enum is in the table (EnumNamesTest checks the ones in use).
  constexpr const char* Name(E e) const {
    for (const EnumEntry<E>& x : entries) {
      if (x.value == e) return x.name;
    }
    return "?";
  }
  // The names, in the table's order, joined by sep.
  std::string Choices(absl::string_view sep = "|") const {
    std::string out;
    for (const EnumEntry<E>& x : entries) absl::StrAppend(&out, out.empty() ? "" : sep, x.name);
    return out;
  }
  // INVALID_ARGUMENT naming the value and the choices for anything else.
  absl::StatusOr<E> Parse(absl::string_view s) const {
    for (const EnumEntry<E>& x : entries) {
      if (s == x.name) return x.value;
    }
    return absl::InvalidArgumentError(
        absl::StrCat(what, " '", s, "' is not one of ", Choices(", ")));
  }
};

}  // namespace moe

#endif  // MOE_SERVICES_COMMON_ENUM_NAMES_H_
