// safetensors files: a validating reader over a read-only mmap, and a streaming writer.
//
// Format: 8-byte little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "BF16", "shape": [r, c], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value"}}
// then the data section; offsets are relative to its start.
//
// The reader trusts nothing: every error names the tensor (or header part) and the problem:
// truncated files, a header length past the end, invalid JSON, duplicate names, unknown dtypes,
// negative or overflowing shapes, byte counts that disagree with dtype x shape, ranges outside
// the data section, and ranges that overlap another tensor's.
//
//   MOE_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open("model-00001-of-00004.safetensors"));
//   const TensorInfo* t = file->Find("...gate.weight");
//   absl::Span<const uint8_t> bytes = file->Data(*t);
#ifndef MOE_SERVICES_CHECKPOINT_SAFETENSORS_H_
#define MOE_SERVICES_CHECKPOINT_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "services/tensor/dtype.h"

namespace moe::checkpoint {

struct TensorInfo {
  std::string name;
  tensor::DType dtype = tensor::DType::kU8;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // data_offsets, relative to the data section
  uint64_t end = 0;

  int64_t NumElements() const;
};

// "[7168, 3584]"
std::string ShapeString(const std::vector<int64_t>& shape);

// Header JSON larger than this is rejected before parsing (real headers are a few MB).
inline constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

class SafetensorsFile {
 public:
  // Maps the file read-only and validates its header.
  static absl::StatusOr<std::shared_ptr<const SafetensorsFile>> Open(const std::string& path);
  // Validates bytes held in memory (tests, the fuzzer); label names it in errors.
  static absl::StatusOr<std::shared_ptr<const SafetensorsFile>> FromBytes(std::string bytes,
                                                                          std::string label);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& label() const { return label_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorInfo* Find(absl::string_view name) const;
  absl::Span<const uint8_t> Data(const TensorInfo& info) const;
  // File offset of the data section (8 + header length): tensor bytes sit at this + begin.
  uint64_t data_offset() const { return data_start_; }

 private:
  SafetensorsFile() = default;
  absl::Status Parse();

  std::string label_;
  const uint8_t* base_ = nullptr;  // the whole file
  uint64_t size_ = 0;
  void* mapping_ = nullptr;  // munmap on destruction when set
  std::string owned_;        // FromBytes storage
  uint64_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

struct TensorSpec {
  std::string name;
  tensor::DType dtype = tensor::DType::kU8;
  std::vector<int64_t> shape;

  int64_t NumBytes() const;
};

// Writes a safetensors file whose layout is fixed up front, so tensors can be streamed in any
// order (and from several threads) without holding them all in memory. The data section is
// contiguous: tensors sorted by element size (largest first, keeping the given order among
// equals), so every tensor is naturally aligned and standard readers accept the file.
//
//   MOE_ASSIGN_OR_RETURN(auto w, SafetensorsWriter::Create(path, specs, {{"format", "pt"}}));
//   MOE_RETURN_IF_ERROR(w->Write(specs[0].name, bytes));  ... for every spec
//   MOE_RETURN_IF_ERROR(w->Finish());
class SafetensorsWriter {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, std::vector<TensorSpec> specs,
      const std::map<std::string, std::string>& metadata);
  ~SafetensorsWriter();

  // Thread-safe; each tensor exactly once, with exactly its byte count.
  absl::Status Write(absl::string_view name, absl::Span<const uint8_t> bytes);
  // Fails unless every tensor was written; closes the file.
  absl::Status Finish();
  uint64_t file_bytes() const { return file_bytes_; }

 private:
  SafetensorsWriter() = default;

  std::string path_;
  int fd_ = -1;
  uint64_t data_start_ = 0;
  uint64_t file_bytes_ = 0;
  std::unordered_map<std::string, size_t> index_;
  std::vector<TensorInfo> layout_;
  std::vector<bool> written_;
  std::mutex mu_;
};

// Convenience for small files: writes all tensors at once.
absl::Status WriteSafetensors(
    const std::string& path,
    const std::vector<std::pair<TensorSpec, std::vector<uint8_t>>>& tensors,
    const std::map<std::string, std::string>& metadata = {});

}  // namespace moe::checkpoint

#endif  // MOE_SERVICES_CHECKPOINT_SAFETENSORS_H_
