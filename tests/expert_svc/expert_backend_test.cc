// Where the experts run: the backend rule as a table over devices (none, pre-Ampere, Hopper),
// and on this machine (no GPU) auto's real fallback to the CPU, with its reason kept.
#include "expert-svc/expert_backend.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "services/checkpoint/synthetic.h"
#include "services/numerics/cpu/expert_ffn.h"
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
  ThreadPool pool(1);
  auto b = MakeExpertBackend(Backend::kAuto, cfg, w, numerics::cpu::ScalarKernels(), &pool);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->name().rfind("cpu/", 0), 0u) << (*b)->name();
  EXPECT_NE((*b)->note.find("auto chose the CPU"), std::string::npos) << (*b)->note;
  auto forced = MakeExpertBackend(Backend::kCuda, cfg, w, numerics::cpu::ScalarKernels(), &pool);
  EXPECT_FALSE(forced.ok());
}

// Backends write y where the caller says (a data plane's registered send buffer): every value,
// whatever the memory held before. CPU: the same bits as numerics::cpu::RunExperts' own zeroed
// vector, into memory filled with NaN; echo: each slot is its token's row; rows read in place
// through z_rows as from a gathered copy; a span of another size or a row outside z refused.
TEST(ExpertBackendRun, WritesEveryOutputWhereTheCallerSays) {
  const ModelConfig cfg = *PresetConfig("tiny");
  const int64_t d = cfg.latent, tokens = 5, k = 2;
  const numerics::MoeLayerWeights w = checkpoint::SyntheticExperts(cfg, 1, 0, 4, {});
  ThreadPool pool(2);
  numerics::Routing routing;
  routing.tokens = tokens;
  routing.top_k = k;
  routing.expert_ids = {0, 3, 1, 2, 3, 0, 2, 1, 0, 1};
  routing.weights.assign(static_cast<size_t>(tokens * k), 1.0f);
  std::vector<tensor::Bf16> zv(static_cast<size_t>(tokens * d));
  for (size_t i = 0; i < zv.size(); ++i) {
    zv[i] = tensor::Bf16::FromFloat(static_cast<float>((i * 37) % 29) / 16.0f - 0.9f);
  }
  const tensor::Activations z = tensor::Activations::FromBf16(zv, tokens, d);
  const tensor::Bf16 nan = tensor::Bf16::FromBits(0xffff);

  const std::vector<tensor::Bf16> oracle =
      numerics::cpu::RunExperts(numerics::cpu::ScalarKernels(), &pool, cfg, w, routing, zv.data());
  auto cpu = MakeExpertBackend(Backend::kCpu, cfg, w, numerics::cpu::ScalarKernels(), &pool);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::vector<tensor::Bf16> y(oracle.size(), nan);
  ASSERT_TRUE((*cpu)->Run(routing, z, {}, absl::MakeSpan(y)).ok());
  for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i].bits, oracle[i].bits) << i;

  auto echo = MakeExpertBackend(Backend::kEcho, cfg, w, numerics::cpu::ScalarKernels(), &pool);
  ASSERT_TRUE(echo.ok()) << echo.status();
  std::fill(y.begin(), y.end(), nan);
  ASSERT_TRUE((*echo)->Run(routing, z, {}, absl::MakeSpan(y)).ok());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      for (int64_t c = 0; c < d; ++c) {
        ASSERT_EQ(y[(t * k + j) * d + c].bits, zv[t * d + c].bits) << t << " " << j << " " << c;
      }
    }
  }
  // A shard's batch: one expert per (token, expert) row, each row reading its token's
  // activations in place (z_rows) or from a gathered copy; both the same bits.
  numerics::Routing one = routing;
  one.tokens = tokens * k;
  one.top_k = 1;
  std::vector<int32_t> z_rows(static_cast<size_t>(tokens * k));
  std::vector<tensor::Bf16> rows(y.size());
  for (int64_t r = 0; r < tokens * k; ++r) {
    z_rows[r] = static_cast<int32_t>(r / k);
    std::copy_n(zv.begin() + (r / k) * d, d, rows.begin() + r * d);
  }
  const tensor::Activations gathered = tensor::Activations::FromBf16(rows, tokens * k, d);
  for (ExpertBackend* b : {cpu->get(), echo->get()}) {
    std::vector<tensor::Bf16> from_copy(y.size(), nan), in_place(y.size(), nan);
    ASSERT_TRUE(b->Run(one, gathered, {}, absl::MakeSpan(from_copy)).ok()) << b->name();
    ASSERT_TRUE(b->Run(one, z, z_rows, absl::MakeSpan(in_place)).ok()) << b->name();
    EXPECT_EQ(0, std::memcmp(from_copy.data(), in_place.data(), y.size() * sizeof(tensor::Bf16)))
        << b->name();
    if (b == echo->get()) {  // every slot of a token is its row, whichever way it is read
      EXPECT_EQ(0, std::memcmp(in_place.data(), y.data(), y.size() * sizeof(tensor::Bf16)));
    }
    std::vector<int32_t> bad = z_rows;
    bad[3] = static_cast<int32_t>(tokens);  // one past z's rows
    const absl::Status s = b->Run(one, z, bad, absl::MakeSpan(in_place));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << b->name() << ": " << s;
    EXPECT_NE(s.message().find("token 3 reads row 5 of 5"), std::string::npos) << s;
  }

  for (ExpertBackend* b : {cpu->get(), echo->get()}) {
    std::vector<tensor::Bf16> short_y(oracle.size() - 1, nan);
    const absl::Status s = b->Run(routing, z, {}, absl::MakeSpan(short_y));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << b->name() << ": " << s;
    EXPECT_NE(s.message().find("need " + std::to_string(oracle.size()) + " outputs"),
              std::string::npos)
        << s;
    for (const tensor::Bf16& v : short_y) ASSERT_EQ(v.bits, 0xffff) << b->name();
  }
}

}  // namespace
}  // namespace moe::expert_svc
