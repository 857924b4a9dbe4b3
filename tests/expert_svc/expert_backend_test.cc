// Where the experts run: the backend rule as a table over devices (none, pre-Ampere, Hopper),
// and on this machine (no GPU) auto's real fallback to the CPU, with its reason kept.
#include "expert-svc/expert_backend.h"

#include <gtest/gtest.h>

#include "services/checkpoint/synthetic.h"
#include "services/numerics/cpu/kernels.h"

namespace moe::expert_svc {
namespace {

using numerics::cuda::CudaDeviceInfo;

TEST(ChooseBackend, FollowsTheDeviceTable) {
  const CudaDeviceInfo none{absl::UnavailableError("no usable CUDA device: error 35"), "", 0, 0};
  const CudaDeviceInfo turing{absl::OkStatus(), "Tesla T4", 7, 5};
  const CudaDeviceInfo hopper{absl::OkStatus(), "NVIDIA H200", 9, 0};
  struct Case {
    Backend asked;
    CudaDeviceInfo gpu;
    absl::StatusCode code;
    Backend got;
    std::string note_has;  // "" : no note
  };
  for (const Case& c : {
           Case{Backend::kAuto, hopper, absl::StatusCode::kOk, Backend::kCuda, ""},
           Case{Backend::kAuto, none, absl::StatusCode::kOk, Backend::kCpu, "error 35"},
           Case{Backend::kAuto, turing, absl::StatusCode::kOk, Backend::kCpu,
                "Tesla T4 has compute capability 7.5"},
           Case{Backend::kCuda, hopper, absl::StatusCode::kOk, Backend::kCuda, ""},
           Case{Backend::kCuda, turing, absl::StatusCode::kFailedPrecondition, Backend::kCpu, ""},
           Case{Backend::kCuda, none, absl::StatusCode::kUnavailable, Backend::kCpu, ""},
           Case{Backend::kCpu, hopper, absl::StatusCode::kOk, Backend::kCpu, ""},
           Case{Backend::kEcho, none, absl::StatusCode::kOk, Backend::kEcho, ""},
       }) {
    SCOPED_TRACE(std::string(BackendName(c.asked)) + " on " + c.gpu.name);
    auto choice = ChooseBackend(c.asked, c.gpu);
    EXPECT_EQ(choice.status().code(), c.code) << choice.status();
    if (!choice.ok()) {
      EXPECT_NE(choice.status().message().find("backend cuda"), absl::string_view::npos);
      continue;
    }
    EXPECT_EQ(choice->backend, c.got);
    if (c.note_has.empty()) {
      EXPECT_EQ(choice->note, "");
    } else {
      EXPECT_NE(choice->note.find(c.note_has), std::string::npos) << choice->note;
    }
  }
}

TEST(MakeExpertBackend, AutoFallsBackToTheCpuAndSaysWhyWhereCudaIsUnusable) {
  if (numerics::cuda::CudaDeviceStatus().ok()) GTEST_SKIP() << "this machine has a usable GPU";
  const ModelConfig cfg = *PresetConfig("tiny");
  const numerics::MoeLayerWeights w = checkpoint::SyntheticExperts(cfg, 1, 0, 4, {});
  numerics::cpu::ThreadPool pool(1);
  auto b = MakeExpertBackend(Backend::kAuto, cfg, w, numerics::cpu::ScalarKernels(), &pool);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->name().rfind("cpu/", 0), 0u) << (*b)->name();
  EXPECT_NE((*b)->note.find("auto chose the CPU"), std::string::npos) << (*b)->note;
  auto forced = MakeExpertBackend(Backend::kCuda, cfg, w, numerics::cpu::ScalarKernels(), &pool);
  EXPECT_FALSE(forced.ok());
}

}  // namespace
}  // namespace moe::expert_svc
