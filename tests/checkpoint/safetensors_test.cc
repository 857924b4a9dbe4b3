#include "services/checkpoint/safetensors.h"

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace moe::checkpoint {
namespace {

using tensor::DType;

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "/" + std::to_string(::getpid()) + "_" + name;
}

TEST(Safetensors, WriteThenReadRoundTrips) {
  const std::string path = TempPath("roundtrip.safetensors");
  std::vector<uint8_t> a(6 * 2), b(3 * 4), c(5);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint8_t>(i * 7);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(100 + i);
  for (size_t i = 0; i < c.size(); ++i) c[i] = static_cast<uint8_t>(200 + i);
  ASSERT_TRUE(WriteSafetensors(path,
                               {{{"u8", DType::kU8, {5}}, c},
                                {{"bf16", DType::kBF16, {2, 3}}, a},
                                {{"f32", DType::kF32, {3}}, b}},
                               {{"format", "pt"}})
                  .ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ((*file)->tensors().size(), 3u);
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  const TensorInfo* t = (*file)->Find("bf16");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, DType::kBF16);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 3}));
  auto data = (*file)->Data(*t);
  EXPECT_TRUE(std::equal(data.begin(), data.end(), a.begin(), a.end()));
  data = (*file)->Data(*(*file)->Find("f32"));
  EXPECT_TRUE(std::equal(data.begin(), data.end(), b.begin(), b.end()));
  // Larger element types come first, so every tensor is naturally aligned.
  EXPECT_EQ((*file)->Find("f32")->begin, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*file)->Data(*(*file)->Find("f32")).data()) % 4, 0u);
  EXPECT_EQ((*file)->Find(absl::string_view("missing")), nullptr);
  ::unlink(path.c_str());
}

TEST(Safetensors, HeaderIsPaddedAndLittleEndian) {
  const std::string path = TempPath("header.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{{"x", DType::kU8, {3}}, {1, 2, 3}}}).ok());
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + n + 3);
  EXPECT_EQ(bytes[8], '{');
  ::unlink(path.c_str());
}

TEST(SafetensorsWriter, RejectsMisuse) {
  const std::string path = TempPath("misuse.safetensors");
  auto w = SafetensorsWriter::Create(path, {{"a", DType::kU8, {4}}, {"b", DType::kU8, {2}}}, {});
  ASSERT_TRUE(w.ok());
  const std::vector<uint8_t> four(4), two(2);
  EXPECT_EQ((*w)->Write("a", two).code(), absl::StatusCode::kInvalidArgument);  // wrong size
  EXPECT_EQ((*w)->Write("zzz", four).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*w)->Write("a", four).ok());
  EXPECT_EQ((*w)->Write("a", four).code(), absl::StatusCode::kFailedPrecondition);  // twice
  const absl::Status finish = (*w)->Finish();
  EXPECT_EQ(finish.code(), absl::StatusCode::kFailedPrecondition);  // "b" never written
  EXPECT_NE(std::string(finish.message()).find("\"b\""), std::string::npos);
  EXPECT_FALSE(
      SafetensorsWriter::Create(path, {{"a", DType::kU8, {1}}, {"a", DType::kU8, {1}}}, {}).ok());
  ::unlink(path.c_str());
}

TEST(Safetensors, MissingFileIsNotFound) {
  auto f = SafetensorsFile::Open("/nonexistent/dir/model.safetensors");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace moe::checkpoint
