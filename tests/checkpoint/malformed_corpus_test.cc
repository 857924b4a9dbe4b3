// A corpus of malformed safetensors files: each must be rejected with DATA_LOSS and a message
// that names the problem (and the tensor, where there is one). Then every truncation of a valid
// file, and bounded random byte flips, must never crash the parser. The same inputs seed the
// libFuzzer target in tests/fuzz.
#include <cstring>
#include <string>

#include "gtest/gtest.h"
#include "services/checkpoint/safetensors.h"
#include "services/common/random.h"

namespace moe::checkpoint {
namespace {

std::string FileWithHeader(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += header;
  out.append(data_bytes, '\x11');
  return out;
}

struct Malformed {
  const char* name;
  std::string bytes;
  const char* expect;  // substring of the error message
};

std::vector<Malformed> Corpus() {
  std::vector<Malformed> c;
  c.push_back({"empty", "", "8-byte header length"});
  c.push_back({"short_length", std::string("\x10\x00\x00", 3), "8-byte header length"});
  {
    std::string b = FileWithHeader("{}", 0);
    b[0] = 100;  // claims 100 header bytes, file has 2
    c.push_back({"header_past_end", b, "runs past the end"});
  }
  {
    std::string b(16, '\0');
    b[7] = 0x7f;  // header length near 2^63
    c.push_back({"huge_header_length", b, "exceeds the limit"});
  }
  c.push_back({"not_json", FileWithHeader("{\"a\": [1, 2", 0), "not valid JSON"});
  c.push_back({"not_object", FileWithHeader("[1, 2, 3]", 0), "not an object"});
  c.push_back({"entry_not_object", FileWithHeader(R"({"w": 5})", 0), "\"w\": entry"});
  c.push_back({"missing_dtype",
               FileWithHeader(R"({"w": {"shape": [2], "data_offsets": [0, 2]}})", 2), "dtype"});
  c.push_back({"unknown_dtype",
               FileWithHeader(R"({"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}})", 1),
               "unknown dtype"});
  c.push_back(
      {"negative_dim",
       FileWithHeader(R"({"w": {"dtype": "U8", "shape": [-2], "data_offsets": [0, 2]}})", 2),
       "not a non-negative integer"});
  c.push_back(
      {"float_dim",
       FileWithHeader(R"({"w": {"dtype": "U8", "shape": [2.5], "data_offsets": [0, 2]}})", 2),
       "not a non-negative integer"});
  c.push_back({"overflowing_shape",
               FileWithHeader(R"({"w": {"dtype": "F32", "shape": [1099511627776, 1099511627776],
                                  "data_offsets": [0, 4]}})",
                              4),
               "too many elements"});
  c.push_back(
      {"size_mismatch",
       FileWithHeader(R"({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 10]}})", 10),
       "holds 10 bytes but BF16 [2, 3] needs 12"});
  c.push_back({"reversed_offsets",
               FileWithHeader(R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [4, 2]}})", 4),
               "reversed"});
  c.push_back({"bad_offsets",
               FileWithHeader(R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0]}})", 2),
               "data_offsets"});
  c.push_back({"past_end",
               FileWithHeader(R"({"w": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}})", 5),
               "run past the end of the 5-byte data section"});
  c.push_back({"overlap",
               FileWithHeader(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                                  "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}})",
                              6),
               "overlap tensor \"a\""});
  c.push_back({"duplicate_name",
               FileWithHeader(R"({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                                  "a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}})",
                              2),
               "more than once"});
  c.push_back(
      {"metadata_not_strings", FileWithHeader(R"({"__metadata__": {"k": 1}})", 0), "__metadata__"});
  c.push_back({"bad_utf8", FileWithHeader("{\"\xff\xfe\": 1}", 0), "not valid JSON"});
  return c;
}

TEST(SafetensorsCorpus, EachMalformedFileIsRejectedWithItsReason) {
  for (const Malformed& m : Corpus()) {
    auto f = SafetensorsFile::FromBytes(m.bytes, m.name);
    ASSERT_FALSE(f.ok()) << m.name << " was accepted";
    EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss) << m.name;
    EXPECT_NE(std::string(f.status().message()).find(m.expect), std::string::npos)
        << m.name << ": " << f.status();
    EXPECT_NE(std::string(f.status().message()).find(m.name), std::string::npos)
        << "the label is missing: " << f.status();
  }
}

std::string ValidFile() {
  return FileWithHeader(R"({"__metadata__": {"format": "pt"},
      "gate": {"dtype": "BF16", "shape": [2, 4], "data_offsets": [0, 16]},
      "bias": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
      "packed": {"dtype": "U8", "shape": [2, 3], "data_offsets": [24, 30]},
      "empty": {"dtype": "U8", "shape": [0], "data_offsets": [30, 30]}})",
                        30);
}

TEST(SafetensorsCorpus, ValidBaseFileParses) {
  auto f = SafetensorsFile::FromBytes(ValidFile(), "valid");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->tensors().size(), 4u);
  EXPECT_EQ((*f)->Data(*(*f)->Find("packed")).size(), 6u);
}

TEST(SafetensorsCorpus, EveryTruncationIsRejected) {
  const std::string valid = ValidFile();
  for (size_t len = 0; len < valid.size(); ++len) {
    auto f = SafetensorsFile::FromBytes(valid.substr(0, len), "truncated");
    // Cutting only data bytes after "packed" ends would still be valid; everything shorter
    // than the full file loses data that some tensor claims.
    EXPECT_FALSE(f.ok()) << "length " << len;
  }
}

TEST(SafetensorsCorpus, RandomByteFlipsNeverCrash) {
  const std::string valid = ValidFile();
  Rng rng(1234);
  int accepted = 0, rejected = 0;
  for (int trial = 0; trial < 5000; ++trial) {
    std::string b = valid;
    const int flips = 1 + static_cast<int>(rng.Next() % 4);
    for (int i = 0; i < flips; ++i) {
      b[rng.Next() % b.size()] = static_cast<char>(rng.Next() & 0xff);
    }
    auto f = SafetensorsFile::FromBytes(b, "mutant");
    if (f.ok()) {
      ++accepted;
      for (const TensorInfo& t : (*f)->tensors()) {
        ASSERT_LE(t.end, b.size());
        unsigned sum = 0;  // touch every byte the parser vouched for (ASan checks the range)
        for (uint8_t v : (*f)->Data(t)) sum += v;
        (void)sum;
      }
    } else {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 0);
  EXPECT_GT(accepted, 0);  // flips inside the data section leave a valid file
}

}  // namespace
}  // namespace moe::checkpoint
