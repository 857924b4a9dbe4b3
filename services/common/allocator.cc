#include "services/common/allocator.h"

#include <dlfcn.h>

#include <string>

namespace moe {

const char* AllocatorName() {
  // tc_version is tcmalloc's own entry point. Looked up at run time rather than called, so the
  // answer is what the process loaded (a build that links tcmalloc but runs under a preload of
  // another allocator still answers truthfully about who serves malloc: see below).
  static const std::string name = [] {
    using Version = const char* (*)(int*, int*, const char**);
    auto version = reinterpret_cast<Version>(dlsym(RTLD_DEFAULT, "tc_version"));
    // Who serves malloc: the library that defines the first `malloc` in lookup order.
    Dl_info info{};
    void* malloc_symbol = dlsym(RTLD_DEFAULT, "malloc");
    const bool tcmalloc_serves = version != nullptr && malloc_symbol != nullptr &&
                                 dladdr(malloc_symbol, &info) != 0 && info.dli_fname != nullptr &&
                                 std::string(info.dli_fname).find("tcmalloc") != std::string::npos;
    if (!tcmalloc_serves) return std::string("glibc malloc");
    int major = 0, minor = 0;
    const char* patch = "";
    version(&major, &minor, &patch);
    return "tcmalloc " + std::to_string(major) + "." + std::to_string(minor) +
           (patch != nullptr ? patch : "");
  }();
  return name.c_str();
}

}  // namespace moe
