// The kernel choice by measurement (services/numerics/cpu/kernel_choice.h): the decision rule on
// known timings, the cache file's form and its parser against hostile files, and real processes
// racing to measure on one machine agreeing on one file.
#include "services/numerics/cpu/kernel_choice.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "services/numerics/cpu/machine_limits.h"

namespace moe::numerics::cpu {
namespace {

bool CpuHas(Isa isa) { return CapIsa(isa) == isa; }

// Timings with `rows` GFLOP/s for the row kernels at every count and the panel at `panel`.
std::vector<KernelTiming> Timings(Isa isa, double rows, const std::map<int64_t, double>& panel) {
  std::vector<KernelTiming> t;
  for (int64_t n : {1, 2, 4, 8, 16, 32, 64, 128}) t.push_back({isa, false, n, rows * 1e9});
  for (const auto& [n, f] : panel) t.push_back({isa, true, n, f * 1e9});
  return t;
}

std::string TempDir(const std::string& name) {
  std::string dir = ::testing::TempDir() + "kernel_choice_" + name + "_" + std::to_string(getpid());
  std::system(("rm -rf '" + dir + "'").c_str());
  return dir;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteAll(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
}

// tiny's expert shape: a probe of a few milliseconds.
constexpr int64_t kLatent = 128, kInter = 96;

TEST(KernelChoice, PanelFromIsWhereThePanelWinsForGood) {
  if (!CpuHas(Isa::kAvx2)) GTEST_SKIP() << "no AVX2 on this CPU: the set is not run";
  const KernelSets avx2{false, Isa::kAvx2};
  // Rows at 10 GFLOP/s everywhere; the panel passes them at 8, falls back at 16, wins from 32.
  KernelChoice c = DecideKernels(
      avx2,
      Timings(Isa::kAvx2, 10, {{2, 1}, {4, 2}, {8, 12}, {16, 9}, {32, 12}, {64, 20}, {128, 30}}));
  EXPECT_EQ(c.decode, Isa::kAvx2);
  EXPECT_EQ(c.prefill, Isa::kAvx2);
  EXPECT_EQ(c.panel_from, 32);
  EXPECT_EQ(c.table.panel_from, 32);
  EXPECT_EQ(c.table.mxfp4_rows_tm, KernelsFor(Isa::kAvx2).mxfp4_rows_tm);
  // A panel that never catches up is never used.
  c = DecideKernels(avx2, Timings(Isa::kAvx2, 50, {{2, 1}, {64, 20}, {128, 49}}));
  EXPECT_EQ(c.panel_from, kNoPanel);
  EXPECT_EQ(KernelsName(c.table), "avx2");
  // The scalar set has no panel kernel.
  c = DecideKernels({false, Isa::kScalar}, {});
  EXPECT_EQ(c.decode, Isa::kScalar);
  EXPECT_EQ(c.panel_from, kNoPanel);
}

TEST(KernelChoice, DecodeAndPrefillSetsAreChosenSeparately) {
  if (!CpuHas(Isa::kAvx512Bf16)) {
    GTEST_SKIP() << "needs AVX2, AVX-512 and AVX512-BF16 (this CPU's best: " << IsaName(DetectIsa())
                 << ")";
  }
  // BF16 rows fastest at 1-8 tokens (as on AMD Zen 4), the AVX2 panel fastest at 64-128.
  std::vector<KernelTiming> t = Timings(Isa::kAvx512Bf16, 30, {{2, 1}, {64, 50}, {128, 60}});
  for (const KernelTiming& x : Timings(Isa::kAvx512, 20, {{2, 1}, {64, 55}, {128, 60}}))
    t.push_back(x);
  for (const KernelTiming& x :
       Timings(Isa::kAvx2, 10, {{2, 1}, {16, 31}, {32, 40}, {64, 70}, {128, 80}})) {
    t.push_back(x);
  }
  const KernelChoice c = DecideKernels(KernelSets{}, t);
  EXPECT_EQ(c.decode, Isa::kAvx512Bf16);
  EXPECT_EQ(c.prefill, Isa::kAvx2);
  // AVX2's panel beats BF16's rows (30) from 16 tokens on (no timing at 8: not a win there).
  EXPECT_EQ(c.panel_from, 16);
  EXPECT_EQ(c.table.mxfp4_rows, KernelsFor(Isa::kAvx512Bf16).mxfp4_rows);
  EXPECT_EQ(c.table.mx_layout, MxLayout::kBf16Pairs);
  EXPECT_EQ(c.table.mxfp4_rows_tm, KernelsFor(Isa::kAvx2).mxfp4_rows_tm);
  EXPECT_EQ(c.table.tm_layout, MxLayout::kByteLut);
  EXPECT_EQ(KernelsName(c.table), "avx512bf16+avx2");
}

TEST(KernelChoice, MeasuresEverySetAtEveryCount) {
  ThreadPool pool(2);
  const std::vector<KernelTiming> t = MeasureKernels(KernelSets{}, kLatent, kInter, &pool);
  int sets = 0;
  for (Isa isa : kSimdIsas) {
    if (!CpuHas(isa)) continue;
    ++sets;
    for (int64_t n : {1, 2, 4, 8, 16, 32, 64, 128}) {
      for (bool panel : {false, true}) {
        if (panel && n == 1) continue;
        int found = 0;
        for (const KernelTiming& x : t) {
          if (x.isa == isa && x.panel == panel && x.tokens == n) {
            ++found;
            EXPECT_GT(x.flops_per_second, 1e6) << IsaName(isa) << " " << n;
          }
        }
        EXPECT_EQ(found, 1) << IsaName(isa) << (panel ? " panel " : " rows ") << n;
      }
    }
  }
  if (sets == 0) {
    EXPECT_EQ(t.size(), 8u);  // scalar only: its rows at 8 counts, no panel
  }
}

TEST(KernelChoice, FileRoundTrips) {
  KernelChoice c =
      DecideKernels(KernelSets{}, MeasureKernels(KernelSets{}, kLatent, kInter, nullptr));
  c.seconds = 0.25;
  c.steady = false;
  c.unsteady = "avx2 rows at 8 tokens per expert: a burst\nover two lines";
  c.attempts = 3;
  c.load_average = 1.75;
  c.read_bytes_per_second = 41.5e9;
  c.measured_at = 1764800000;
  const std::string text = FormatKernelChoice(c, kLatent, kInter, /*pinned=*/false);
  auto back = ParseKernelChoice(text, KernelSets{}, kLatent, kInter);
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << text;
  EXPECT_EQ(back->decode, c.decode);
  EXPECT_EQ(back->prefill, c.prefill);
  EXPECT_EQ(back->panel_from, c.panel_from);
  EXPECT_EQ(back->cpu, CpuModel());
  EXPECT_FALSE(back->pinned);
  ASSERT_EQ(back->timings.size(), c.timings.size());
  for (size_t i = 0; i < c.timings.size(); ++i) {
    EXPECT_GE(c.timings[i].spread, 0.0);  // measured: every probe says how steady it was
    EXPECT_NEAR(back->timings[i].spread, c.timings[i].spread, 5e-4);
  }
  EXPECT_FALSE(back->steady);
  EXPECT_EQ(back->unsteady, "avx2 rows at 8 tokens per expert: a burst over two lines");
  EXPECT_EQ(back->attempts, 3);
  EXPECT_DOUBLE_EQ(back->load_average, 1.75);
  EXPECT_DOUBLE_EQ(back->read_bytes_per_second, 41.5e9);
  EXPECT_EQ(back->measured_at, 1764800000);
  EXPECT_EQ(back->table.mxfp4_rows, c.table.mxfp4_rows);
  EXPECT_EQ(back->table.mxfp4_rows_tm, c.table.mxfp4_rows_tm);
  // Another shape or another set is another file's business.
  EXPECT_FALSE(ParseKernelChoice(text, KernelSets{}, kLatent, kInter + 32).ok());
  EXPECT_FALSE(ParseKernelChoice(text, KernelSets{false, Isa::kAvx2}, kLatent, kInter).ok());
}

// One line of a good file replaced by `line` ("" deletes the key).
std::string WithLine(const std::string& good, const std::string& key, const std::string& line) {
  std::stringstream in(good);
  std::string out, l;
  while (std::getline(in, l)) {
    if (l.rfind(key + " =", 0) == 0) {
      if (!line.empty()) out += line + "\n";
      continue;
    }
    out += l + "\n";
  }
  return out;
}

TEST(KernelChoice, HostileFilesAreRefusedByName) {
  if (DetectIsa() == Isa::kScalar) GTEST_SKIP() << "scalar only: nothing is chosen or cached";
  const KernelChoice c =
      DecideKernels(KernelSets{}, MeasureKernels(KernelSets{}, kLatent, kInter, nullptr));
  const std::string good = FormatKernelChoice(c, kLatent, kInter, false);
  struct Case {
    std::string text, error;
  };
  const std::vector<Case> cases = {
      {"\x01\x02garbage\xff", "not key = value"},
      {good + "colour = blue\n", "unknown key \"colour\""},
      {good + "decode = avx2\n", "decode twice"},
      {WithLine(good, "decode", "decode = avx1024"), "unknown set"},
      {WithLine(good, "decode", ""), "no decode"},
      {WithLine(WithLine(good, "prefill", "prefill = scalar"), "panel_from", "panel_from = 16"),
       "has no panel kernel"},
      {WithLine(good, "panel_from", "panel_from = 0"), "panel_from is 1..4096 or never"},
      {WithLine(good, "panel_from", "panel_from = -5"), "panel_from is 1..4096 or never"},
      {WithLine(good, "panel_from", "panel_from = 99999999999999999999"), "panel_from is"},
      {good + "timing = avx2 rows 1 nan\n", "timing is"},
      {good + "timing = avx2 rows 1 inf\n", "timing is"},
      {good + "timing = avx2 rows 0 5\n", "timing is"},
      {good + "timing = avx2 sideways 4 5\n", "timing is"},
      {WithLine(good, "cpu", "cpu = AMD EPYC 9R14 (family 25 model 17)"), "measured on AMD"},
      {WithLine(good, "version", "version = 999"), "kernel version 999"},
      {WithLine(good, "pinned", "pinned = maybe"), "pinned is true or false"},
      {WithLine(good, "steady", "steady = maybe"), "steady is true or false"},
      {WithLine(good, "attempts", "attempts = 0"), "attempts is 1..100"},
      {WithLine(good, "measured_at", "measured_at = -5"), "measured_at is Unix seconds"},
      {WithLine(good, "load_average", "load_average = nan"), "load_average is a number"},
      {WithLine(good, "read_gbps", "read_gbps = -1"), "read_gbps is a number"},
      {good + "timing = avx2 rows 1 5 nan\n", "timing is"},
      {good + "timing = avx2 rows 1 5 -0.5\n", "timing is"},
      {good + "timing = avx2 rows 1 5 0.1 extra\n", "timing is"},
  };
  for (const Case& k : cases) {
    auto parsed = ParseKernelChoice(k.text, KernelSets{}, kLatent, kInter);
    ASSERT_FALSE(parsed.ok()) << k.text;
    EXPECT_NE(std::string(parsed.status().message()).find(k.error), std::string::npos)
        << parsed.status() << " for: " << k.error;
  }
  // Pinned: another CPU's or another version's file is used as it is.
  auto pinned = ParseKernelChoice(
      WithLine(WithLine(WithLine(good, "pinned", "pinned = true"), "cpu", "cpu = elsewhere"),
               "version", "version = 999"),
      KernelSets{}, kLatent, kInter);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_TRUE(pinned->pinned);
  EXPECT_EQ(pinned->cpu, "elsewhere");
  // A pinned file of version 3 (no steadiness, timings without a spread) is still read.
  const std::string v3 =
      "version = 3\ncpu = elsewhere\nsets = auto\nshape = 128 96\ndecode = " +
      std::string(IsaName(c.decode)) + "\nprefill = " + IsaName(c.prefill) +
      "\npanel_from = never\npinned = true\nmeasured_seconds = 0.170\ntiming = " +
      IsaName(c.decode) + " rows 1 34.05\n";
  auto old = ParseKernelChoice(v3, KernelSets{}, kLatent, kInter);
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_TRUE(old->steady);
  ASSERT_EQ(old->timings.size(), 1u);
  EXPECT_EQ(old->timings[0].spread, 0.0);
}

// The steadiness rule on known timings: a probe whose repetitions spread past the bound, and a
// count far under both neighbours (the file this rule was written for recorded avx2 rows at 8
// tokens as 13.7 GFLOP/s against 74-78 around it, measured while the machine was loaded).
TEST(KernelChoice, AProbeThatDisagreesWithItselfIsNamed) {
  std::vector<KernelTiming> t = Timings(Isa::kAvx2, 75, {{2, 10}, {4, 20}, {8, 40}, {16, 70}});
  for (KernelTiming& k : t) k.spread = 0.05;
  EXPECT_EQ(ProbeDisagreement(t, kProbeSpreadBound), "");
  t[3].flops_per_second = 13.7e9;  // rows at 8 tokens
  EXPECT_EQ(ProbeDisagreement(t, kProbeSpreadBound),
            "avx2 rows at 8 tokens per expert: 13.7 GFLOP/s, under half of both neighbours "
            "(75.0, 75.0)");
  t[3].flops_per_second = 40e9;  // above half: a slow count, not a burst
  EXPECT_EQ(ProbeDisagreement(t, kProbeSpreadBound), "");
  t[0].spread = 0.31;  // rows at 1 token
  t[9].spread = 0.6;   // the panel at 4: the worst
  EXPECT_EQ(ProbeDisagreement(t, kProbeSpreadBound),
            "avx2 panel at 4 tokens per expert: repetitions spread 0.60 (bound 0.25)");
  // The first and last counts have one neighbour: never judged by it.
  t = Timings(Isa::kAvx2, 75, {});
  t[0].flops_per_second = 1e9;
  t[7].flops_per_second = 1e9;
  EXPECT_EQ(ProbeDisagreement(t, kProbeSpreadBound), "");
}

// ChooseKernels over a file in each state: what it runs, what it leaves on disk. (Each test
// runs in a process of its own under ctest; each uses directories of its own.)
class KernelChoiceCache : public ::testing::Test {
 protected:
  void SetUp() override {
    if (DetectIsa() == Isa::kScalar) GTEST_SKIP() << "scalar only: nothing is chosen or cached";
  }
  static const KernelChoice& Choose(const std::string& dir) {
    KernelChoiceOptions o;
    o.sets = KernelSets{};
    o.latent = kLatent;
    o.intermediate = kInter;
    o.cache_dir = dir;
    return ChooseKernels(o);
  }
  static std::string PathIn(const std::string& dir) {
    return KernelChoicePath(dir, KernelSets{}, kLatent, kInter);
  }
  // A directory of this test holding `text` as its choice file.
  static std::string DirWith(const std::string& tag, const std::string& text) {
    const std::string dir = TempDir(tag);
    mkdir(dir.c_str(), 0755);
    WriteAll(PathIn(dir), text);
    return dir;
  }
  // A choice no measurement would make: decode avx2, prefill the best set, panel from 7.
  static KernelChoice Hand() {
    KernelChoice hand = DecideKernels(KernelSets{}, {});
    hand.decode = Isa::kAvx2;
    hand.prefill = DetectIsa();
    hand.panel_from = 7;
    return hand;
  }
};

// Empty directory (created, nested): measured and written; the same process asking again gets
// the same object, no second measurement.
TEST_F(KernelChoiceCache, AnEmptyDirectoryIsMeasuredAndWritten) {
  const std::string fresh = TempDir("fresh") + "/a/b";
  const KernelChoice& first = Choose(fresh);
  EXPECT_EQ(first.source, "measured");
  EXPECT_TRUE(first.note.empty()) << first.note;
  EXPECT_EQ(first.path, PathIn(fresh));
  auto on_disk = ParseKernelChoice(ReadAll(PathIn(fresh)), KernelSets{}, kLatent, kInter);
  ASSERT_TRUE(on_disk.ok()) << on_disk.status();
  EXPECT_EQ(on_disk->decode, first.decode);
  EXPECT_EQ(on_disk->panel_from, first.panel_from);
  EXPECT_EQ(&Choose(fresh), &first);
}

// A cached file (written by hand: a choice no measurement would make) is read, not measured.
TEST_F(KernelChoiceCache, ACachedFileIsReadNotMeasured) {
  const KernelChoice& read =
      Choose(DirWith("cached", FormatKernelChoice(Hand(), kLatent, kInter, false)));
  EXPECT_EQ(read.source, "cache");
  EXPECT_EQ(read.decode, Isa::kAvx2);
  EXPECT_EQ(read.prefill, DetectIsa());
  EXPECT_EQ(read.table.panel_from, 7);
  EXPECT_EQ(read.table.mxfp4_rows, KernelsFor(Isa::kAvx2).mxfp4_rows);
  EXPECT_EQ(read.seconds, 0);
}

// A malformed file is measured again and replaced by a valid one; the note says why. A pinned
// file that cannot be used (a key this build does not know) is kept as it is.
TEST_F(KernelChoiceCache, AMalformedFileIsReplacedAndAnUnusablePinnedOneKept) {
  const std::string bad = DirWith("bad", "decode = avx1024\n");
  const KernelChoice& redone = Choose(bad);
  EXPECT_EQ(redone.source, "measured");
  EXPECT_NE(redone.note.find("replaced a file"), std::string::npos) << redone.note;
  EXPECT_TRUE(ParseKernelChoice(ReadAll(PathIn(bad)), KernelSets{}, kLatent, kInter).ok());
  const std::string pinned_text =
      FormatKernelChoice(Hand(), kLatent, kInter, /*pinned=*/true) + "future_key = 1\n";
  const std::string kept = DirWith("kept", pinned_text);
  const KernelChoice& around = Choose(kept);
  EXPECT_EQ(around.source, "measured");
  EXPECT_NE(around.note.find("pinned file not usable, kept"), std::string::npos) << around.note;
  EXPECT_EQ(ReadAll(PathIn(kept)), pinned_text);
}

// The file is a symlink to someone else's file: not followed, not written through. A file
// larger than 1 MiB: refused before parsing.
TEST_F(KernelChoiceCache, ASymlinkIsNotFollowedAndAHugeFileNotParsed) {
  const std::string link = TempDir("link");
  mkdir(link.c_str(), 0755);
  const std::string victim = link + "/victim";
  WriteAll(victim, "precious\n");
  ASSERT_EQ(symlink(victim.c_str(), PathIn(link).c_str()), 0);
  const KernelChoice& linked = Choose(link);
  EXPECT_EQ(linked.source, "measured");
  EXPECT_EQ(ReadAll(victim), "precious\n");
  const KernelChoice& huge = Choose(DirWith("big", std::string(2 << 20, '#')));
  EXPECT_EQ(huge.source, "measured");
  EXPECT_NE(huge.note.find("larger than 1 MiB"), std::string::npos) << huge.note;
}

// An unsteady choice is used by processes that start within the hour of it (every process of
// one start runs the same kernels), and measured again after.
TEST_F(KernelChoiceCache, AnUnsteadyChoiceIsUsedWithinTheHourAndMeasuredAfter) {
  KernelChoice noisy = Hand();
  noisy.steady = false;
  noisy.unsteady = "avx2 rows at 8 tokens per expert: under half of both neighbours";
  noisy.measured_at = static_cast<int64_t>(std::time(nullptr)) - 60;
  const KernelChoice& kept_noisy =
      Choose(DirWith("unsteady_recent", FormatKernelChoice(noisy, kLatent, kInter, false)));
  EXPECT_EQ(kept_noisy.source, "cache");
  EXPECT_FALSE(kept_noisy.steady);
  EXPECT_EQ(kept_noisy.decode, Isa::kAvx2);
  noisy.measured_at -= 2 * kUnsteadyKeepSeconds;
  const KernelChoice& remeasured =
      Choose(DirWith("unsteady_stale", FormatKernelChoice(noisy, kLatent, kInter, false)));
  EXPECT_EQ(remeasured.source, "measured");
  EXPECT_NE(remeasured.note.find("an unsteady measurement of"), std::string::npos)
      << remeasured.note;
}

// A machine too noisy for the bound (0: every probe spreads more): measured max_attempts
// times, used, and written marked unsteady with its machine state. The reason named is a
// spread, or, where a burst of load made a count fall under half of both neighbours (which
// outranks every spread; seen once under ctest -j2 with a build beside it), that.
TEST_F(KernelChoiceCache, AMachineTooNoisyForTheBoundIsWrittenUnsteady) {
  const std::string dir = TempDir("never_steady");
  KernelChoiceOptions o;
  o.sets = KernelSets{};
  o.latent = kLatent;
  o.intermediate = kInter;
  o.cache_dir = dir;
  o.spread_bound = 0;
  o.max_attempts = 2;
  const KernelChoice& c = ChooseKernels(o);
  EXPECT_EQ(c.source, "measured");
  EXPECT_FALSE(c.steady);
  EXPECT_EQ(c.attempts, 2);
  EXPECT_TRUE(c.unsteady.find("repetitions spread") != std::string::npos ||
              c.unsteady.find("under half of both neighbours") != std::string::npos)
      << c.unsteady;
  EXPECT_NE(c.Summary().find("unsteady after 2 attempts"), std::string::npos) << c.Summary();
  auto file = ParseKernelChoice(ReadAll(PathIn(dir)), KernelSets{}, kLatent, kInter);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_FALSE(file->steady);
  EXPECT_EQ(file->attempts, 2);
  EXPECT_GT(file->read_bytes_per_second, 1e8);
  EXPECT_GE(file->load_average, 0);
  EXPECT_NEAR(file->measured_at, std::time(nullptr), 120);
}

// A directory that cannot be written (a read-only mount): measured, used, said. (As root every
// directory is writable: not tried.)
TEST_F(KernelChoiceCache, AReadOnlyDirectoryIsMeasuredAndSaid) {
  if (geteuid() == 0) GTEST_SKIP() << "root writes a read-only directory";
  const std::string ro = TempDir("ro");
  mkdir(ro.c_str(), 0555);
  const KernelChoice& unwritten = Choose(ro);
  EXPECT_EQ(unwritten.source, "measured");
  EXPECT_NE(unwritten.note.find("not cached"), std::string::npos) << unwritten.note;
}

// Processes started together on an empty cache: one measures, the others wait for its file and
// read it, so every process runs the same kernels.
TEST(KernelChoice, ConcurrentProcessesAgreeOnOneFile) {
  if (DetectIsa() == Isa::kScalar) GTEST_SKIP() << "scalar only: nothing is chosen or cached";
  const std::string dir = TempDir("race");
  const std::string out = dir + ".out";
  std::system(("rm -f '" + out + "'.*").c_str());
  std::string cmd = "set -e; ";
  for (int i = 0; i < 4; ++i) {
    cmd += "MOE_KERNEL_CACHE='" + dir + "' '" MOE_TOOL "' kernels --config tiny > '" + out + "." +
           std::to_string(i) + "' 2>/dev/null & ";
  }
  cmd += "wait";
  ASSERT_EQ(std::system(("bash -c \"" + cmd + "\"").c_str()), 0);
  int measured = 0, cached = 0;
  std::string choice;
  for (int i = 0; i < 4; ++i) {
    const std::string text = ReadAll(out + "." + std::to_string(i));
    const size_t at = text.find("choice: ");
    ASSERT_NE(at, std::string::npos) << text;
    const std::string line = text.substr(at, text.find('(', at) - at);
    if (choice.empty()) choice = line;
    EXPECT_EQ(line, choice) << "process " << i;
    measured += text.find("; measured ") != std::string::npos;
    cached += text.find("; cache ") != std::string::npos;
  }
  EXPECT_EQ(measured, 1);
  EXPECT_EQ(cached, 3);
  std::printf("4 processes: %s\n", choice.c_str());
}

// The vdpbf16ps probe counts its own flops (12 chains x 32 multiply-adds per iteration) and
// is measured only where the CPU has the instruction.
TEST(MachineLimits, Bf16DotPeakIsMeasuredWhereTheCpuHasIt) {
  ThreadPool pool(1);
  if (!CpuHas(Isa::kAvx512Bf16)) {
    EXPECT_EQ(MeasureBf16DotPeak(&pool, 0.02), 0);
    GTEST_SKIP() << "no AVX512-BF16 on this CPU: the probe is not run";
  }
  ASSERT_NE(KernelsFor(Isa::kAvx512Bf16).dot_probe, nullptr);
  EXPECT_EQ(KernelsFor(Isa::kAvx512Bf16).dot_probe(1000), 2.0 * 32 * 12 * 1000);
  EXPECT_EQ(KernelsFor(Isa::kAvx512).dot_probe, nullptr);
  const double peak = MeasureBf16DotPeak(&pool, 0.02);
  EXPECT_GT(peak, 1e9);
  EXPECT_LT(peak, 1e14);
}

// A table is data: any CPU may read any set's table (the choice and the tests list them all);
// only its kernels need the ISA. AmxKernels() once copied its table with AVX-512 moves and stopped
// the process (SIGILL) on an AVX2-only AMD Zen 3; on such a CPU this test is what fails.
TEST(KernelChoice, EveryTableIsReadableOnAnyCpu) {
  for (const auto& e : kIsaNames.entries) {
    const KernelTable& k = KernelsFor(e.value);
    EXPECT_EQ(k.isa, e.value) << e.name;
    EXPECT_STREQ(k.name, e.name);
    EXPECT_NE(k.mxfp4_rows, nullptr) << e.name;
  }
  std::printf("this CPU runs up to %s; every table was read\n", IsaName(DetectIsa()));
}

TEST(KernelChoice, SetsParse) {
  EXPECT_TRUE(ParseKernelSets("auto")->automatic);
  EXPECT_EQ(ParseKernelSets("avx2")->only, Isa::kAvx2);
  EXPECT_FALSE(ParseKernelSets("avx2")->automatic);
  EXPECT_EQ(KernelSetsName(KernelSets{}), "auto");
  EXPECT_EQ(KernelSetsName({false, Isa::kAvx512}), "avx512");
  // Every set by its name in the ISA table, and a bad one refused listing them all from it.
  for (const auto& e : kIsaNames.entries) {
    auto sets = ParseKernelSets(e.name);
    ASSERT_TRUE(sets.ok()) << e.name;
    EXPECT_EQ(sets->only, e.value);
    EXPECT_EQ(KernelSetsName(*sets), e.name);
  }
  auto bad = ParseKernelSets("fastest");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(),
            "unknown CPU kernel set \"fastest\"; use auto, scalar, avx2, avx512, avx512bf16, "
            "avx512amx");
}

}  // namespace
}  // namespace moe::numerics::cpu
