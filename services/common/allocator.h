// The process's memory allocator, and why it is not glibc's.
//
// Every batch of the data plane allocates buffers of its payload's size (the reply's bytes in a
// protobuf, a gRPC slice, the rows an expert computes) and frees them when it is answered. glibc
// hands such buffers back to the kernel on free (blocks above its mmap threshold are unmapped,
// and the heap's top is trimmed past the trim threshold; both thresholds move with the sizes
// seen, up to 32 MiB), so the next batch faults every page in again: in a VM each fault costs
// 2-6 us, a freshly faulted byte moves at 0.7-1.9 GB/s, and a round trip past about 1 MiB of
// replies took 5-30x longer per doubling (docs/data-plane.md, "Large batches"). The services,
// tools, benchmarks and tests therefore link gperftools' tcmalloc (Debian
// libgoogle-perftools-dev), which keeps freed spans for reuse and releases them gradually:
// measured with tests/bench/dispatch_bench.cc, 0-117 page faults per round trip up to 16 MiB of
// replies and a time per byte flat to 64 MiB, against 1,616 at 2 MiB and 81,926 at 64 MiB with
// glibc (whose knobs stop at 32 MiB). A sanitizer build (-DMOE_ALLOCATOR=system) keeps glibc's.
//
//   MOE_LOG_INFO("allocator: {}", moe::AllocatorName());  // "tcmalloc 2.10" or "glibc malloc"
#ifndef MOE_SERVICES_COMMON_ALLOCATOR_H_
#define MOE_SERVICES_COMMON_ALLOCATOR_H_

namespace moe {

// The allocator this process runs: "tcmalloc MAJOR.MINOR" when tcmalloc serves malloc (asked of
// the library that answers, not of the build), "glibc malloc" otherwise.
const char* AllocatorName();

}  // namespace moe

#endif  // MOE_SERVICES_COMMON_ALLOCATOR_H_
