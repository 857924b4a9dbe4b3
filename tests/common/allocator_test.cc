// The allocator every binary runs (services/common/allocator.h): it is the one the build chose,
// asked of the process, and it gives a freed large buffer back to the next allocation without
// the kernel faulting its pages in again (what made a batch past about 1 MiB 5-30x slower).
#include "services/common/allocator.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace moe {
namespace {

int64_t MinorFaults() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return r.ru_minflt;
}

// Allocates `bytes`, writes every page (as a received payload does), frees: `rounds` times.
void AllocateTouchFree(size_t bytes, int rounds) {
  for (int i = 0; i < rounds; ++i) {
    auto* p = new char[bytes];
    for (size_t off = 0; off < bytes; off += 4096) p[off] = static_cast<char>(i + off);
    // Keeps the writes (and so the allocation) from being optimized away.
    asm volatile("" : : "r"(p) : "memory");
    delete[] p;
  }
}

TEST(Allocator, TheProcessRunsTheAllocatorTheBuildChose) {
#ifdef MOE_ALLOCATOR_TCMALLOC
  EXPECT_EQ(std::string(AllocatorName()).rfind("tcmalloc ", 0), 0u) << AllocatorName();
#else
  EXPECT_STREQ(AllocatorName(), "glibc malloc");
#endif
}

// From 1 to 64 MiB (the data plane's payloads: one batch's replies), the second and later
// rounds of allocate-write-free fault in less than 1/16 of the pages they write; glibc faulted
// in every page of every round at 2 MiB and above (dispatch_bench's faults per round trip).
TEST(Allocator, FreedLargeBuffersAreReusedWithoutFaultingAgain) {
#ifndef MOE_ALLOCATOR_TCMALLOC
  GTEST_SKIP() << "built with -DMOE_ALLOCATOR=system (" << AllocatorName()
               << "): glibc gives large blocks back to the kernel";
#endif
  for (size_t mib : {1, 2, 4, 16, 64}) {
    const size_t bytes = mib << 20;
    AllocateTouchFree(bytes, 1);  // the first round faults its pages in
    constexpr int kRounds = 8;
    const int64_t before = MinorFaults();
    AllocateTouchFree(bytes, kRounds);
    const int64_t faults = MinorFaults() - before;
    const int64_t pages_written = static_cast<int64_t>(bytes / 4096) * kRounds;
    EXPECT_LT(faults, pages_written / 16)
        << mib << " MiB: " << faults << " page faults for " << pages_written << " pages written";
  }
}

}  // namespace
}  // namespace moe
