// The flag library every binary uses: value forms, booleans, lists, custom types, positional
// arguments, --help (exit 0), and errors that name the flag (exit 2), with the nearest known
// name for a typo.
#include "services/common/flags.h"

#include <string>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "services/common/logging.h"
#include "services/common/progress.h"

namespace moe {
namespace {

struct Opts {
  std::string name = "x";
  int port = 0;
  int64_t big = 0;
  uint64_t seed = 1;
  double skew = 0.0;
  bool verbose = false;
  std::vector<int64_t> layers;
  int level = 0;  // custom: "low" | "high"
};

int ParseArgs(std::vector<std::string> args, Opts* o,
              std::vector<std::string>* positional = nullptr) {
  SvcFlags f("prog", "a test program");
  f.String("name", &o->name, "a name");
  f.Int("port", &o->port, "a port");
  f.Int64("big", &o->big, "a big number");
  f.Uint64("seed", &o->seed, "a seed");
  f.Double("skew", &o->skew, "a skew");
  f.Bool("verbose", &o->verbose, "talk more");
  f.IntList("layers", &o->layers, "layers");
  f.Custom("level", "low", "low or high", [o](const std::string& s) {
    if (s != "low" && s != "high") return false;
    o->level = s == "high";
    return true;
  });
  std::vector<char*> argv = {const_cast<char*>("prog")};
  for (std::string& a : args) argv.push_back(a.data());
  const int rc = f.Parse(static_cast<int>(argv.size()), argv.data());
  if (positional != nullptr) *positional = f.positional();
  return rc;
}

TEST(Flags, ParsesEveryFormIntoTheOptions) {
  Opts o;
  std::vector<std::string> pos;
  EXPECT_EQ(
      ParseArgs({"--name=abc", "--port", "81", "--big=-5", "--seed", "9", "--skew=1.5", "--verbose",
                 "--layers=1,2,3", "--level", "high", "cmd", "--", "--not-a-flag"},
                &o, &pos),
      -1);
  EXPECT_EQ(o.name, "abc");
  EXPECT_EQ(o.port, 81);
  EXPECT_EQ(o.big, -5);
  EXPECT_EQ(o.seed, 9u);
  EXPECT_EQ(o.skew, 1.5);
  EXPECT_TRUE(o.verbose);
  EXPECT_EQ(o.layers, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(o.level, 1);
  EXPECT_EQ(pos, (std::vector<std::string>{"cmd", "--not-a-flag"}));
  Opts b;
  b.verbose = true;
  EXPECT_EQ(ParseArgs({"--verbose=false", "--layers="}, &b), -1);
  EXPECT_FALSE(b.verbose);
  EXPECT_TRUE(b.layers.empty());
}

TEST(Flags, HelpExitsZeroAndBadFlagsExitTwo) {
  struct Case {
    std::vector<std::string> args;
    int rc;
  };
  for (const Case& c : std::vector<Case>{
           {{"--help"}, 0},
           {{"-h"}, 0},
           {{"--port=1", "--help", "--bogus"}, 0},  // help wins wherever it stands
           {{"--skwe", "1.0"}, 2},                  // a typo is an error, never ignored
           {{"--port"}, 2},                         // no value
           {{"--port=eighty"}, 2},
           {{"--verbose=maybe"}, 2},
           {{"--layers=1,x"}, 2},
           {{"--level=middle"}, 2},
       }) {
    Opts o;
    EXPECT_EQ(ParseArgs(c.args, &o), c.rc) << c.args[0];
  }
}

TEST(Flags, AnUnknownFlagNamesTheNearestKnownOne) {
  Opts o;
  ::testing::internal::CaptureStderr();
  const int typo = ParseArgs({"--skwe=1"}, &o);
  const int kebab = ParseArgs({"--very-bose"}, &o);
  const int far = ParseArgs({"--completely_else"}, &o);
  const std::string text = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(typo, 2);
  EXPECT_EQ(kebab, 2);
  EXPECT_EQ(far, 2);
  EXPECT_NE(text.find("unknown flag --skwe, did you mean --skew?"), std::string::npos) << text;
  EXPECT_NE(text.find("unknown flag --completely_else (see --help)"), std::string::npos) << text;
}

enum class Color { kRed, kBlue };
const char* ColorName(Color c) { return c == Color::kRed ? "red" : "blue"; }
absl::StatusOr<Color> ParseColor(const std::string& s) {
  if (s == "red") return Color::kRed;
  if (s == "blue") return Color::kBlue;
  return absl::InvalidArgumentError("color '" + s + "' is not red or blue");
}

TEST(Flags, TypedValuesUseTheirOwnParser) {
  for (auto [arg, rc, want] : std::vector<std::tuple<std::string, int, Color>>{
           {"--color=blue", -1, Color::kBlue}, {"--color=green", 2, Color::kRed}}) {
    Color c = Color::kRed;
    SvcFlags f("prog", "typed");
    f.Typed("color", &c, ColorName, ParseColor, "red|blue");
    std::string a = arg;
    char* argv[] = {const_cast<char*>("prog"), a.data()};
    ::testing::internal::CaptureStderr();
    EXPECT_EQ(f.Parse(2, argv), rc) << arg;
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(c, want) << arg;
    if (rc == 2) {
      EXPECT_NE(err.find("color 'green' is not red or blue"), std::string::npos) << err;
    }
  }
}

// One table names, parses and lists an enum: every entry round-trips, anything else is refused
// naming the choices, and flags.Enum's help and default come from the same table.
constexpr EnumNames<Color, 2> kColors{"color", {{{Color::kRed, "red"}, {Color::kBlue, "blue"}}}};

TEST(EnumNames, OneTableNamesParsesAndListsAnEnum) {
  for (const auto& e : kColors.entries) {
    EXPECT_EQ(std::string(kColors.Name(e.value)), e.name);
    auto back = kColors.Parse(e.name);
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, e.value);
  }
  EXPECT_EQ(kColors.Choices(), "red|blue");
  auto bad = kColors.Parse("Red");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "color 'Red' is not one of red, blue");
  Color c = Color::kBlue;
  SvcFlags f("prog", "enum");
  f.Enum("color", &c, kColors, "the color");
  std::string a = "--color=red";
  char* argv[] = {const_cast<char*>("prog"), a.data()};
  EXPECT_EQ(f.Parse(2, argv), -1);
  EXPECT_EQ(c, Color::kRed);
  std::string h = "--help";
  char* help[] = {const_cast<char*>("prog"), h.data()};
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(f.Parse(2, help), 0);
  const std::string text =
      ::testing::internal::GetCapturedStdout() + ::testing::internal::GetCapturedStderr();
  EXPECT_NE(text.find("red|blue: the color"), std::string::npos) << text;
}

// The progress line's figures, from known values (and the edges: nothing done, all done).
TEST(Progress, FormatsBytesPercentRateAndTimeLeft) {
  EXPECT_EQ(FormatProgress("writing k3", 4'200'000'000, 15'800'000'000, 13.5),
            "writing k3: 4.2 GB of 15.8 GB (26%), 311 MB/s, 37 s left");
  EXPECT_EQ(FormatProgress("loading", 0, 50'000'000, 0.0), "loading: 0.0 KB of 50.0 MB (0%)");
  EXPECT_EQ(FormatProgress("loading", 50'000'000, 50'000'000, 0.5),
            "loading: 50.0 MB of 50.0 MB (100%), 100 MB/s");
}

// Off a terminal (as here), progress goes to the log: a line per period and a last one.
TEST(Progress, LogsPeriodicLinesAndALastOneOffATerminal) {
  ASSERT_FALSE(StderrIsTerminal());
  InitLogging("progress-test");
  ::testing::internal::CaptureStderr();
  {
    Progress p("writing a test", 3'000'000, std::chrono::seconds(0));
    p.Add(1'000'000);
    p.Add(1'000'000);
    p.Done();
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("info progress-test: writing a test: 1.0 MB of 3.0 MB (33%)"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("writing a test: 2.0 MB of 3.0 MB (66%)"), std::string::npos) << log;
  EXPECT_NE(log.find("writing a test: 2.0 MB in "), std::string::npos) << log;
}

// --log_level is a flag of every binary; a bad level is refused at the flag.
TEST(Logging, EveryBinaryTakesALogLevel) {
  int n = 0;
  SvcFlags flags("t", "test");
  flags.Int("n", &n, "n");
  const char* good[] = {"t", "--log_level=warn", "--n=2"};
  EXPECT_EQ(flags.Parse(3, const_cast<char**>(good)), -1);
  EXPECT_EQ(n, 2);
  EXPECT_EQ(spdlog::get_level(), spdlog::level::warn);
  SvcFlags again("t", "test");
  const char* bad[] = {"t", "--log_level=loud"};
  EXPECT_EQ(again.Parse(2, const_cast<char**>(bad)), 2);
  EXPECT_TRUE(SetLogLevel("info"));
}

}  // namespace
}  // namespace moe
