#include "services/tools/tensor_file.h"

#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "services/checkpoint/safetensors.h"
#include "services/common/status_macros.h"

namespace moe::tools {

using tensor::Bf16;

namespace {

absl::Status Bad(const std::string& label, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(label, ": ", what));
}

// The value of 'key': in a .npy header dict ("{'descr': '<f4', 'fortran_order': False, ...").
std::string HeaderField(absl::string_view header, absl::string_view key) {
  const std::string k = absl::StrCat("'", key, "':");
  const size_t at = header.find(k);
  if (at == absl::string_view::npos) return "";
  absl::string_view rest = absl::StripLeadingAsciiWhitespace(header.substr(at + k.size()));
  if (!rest.empty() && rest[0] == '(') return std::string(rest.substr(0, rest.find(')') + 1));
  if (!rest.empty() && rest[0] == '\'') {
    return std::string(rest.substr(1, rest.find('\'', 1) - 1));
  }
  return std::string(rest.substr(0, rest.find_first_of(",}")));
}

}  // namespace

absl::StatusOr<Matrix> ParseNpy(absl::string_view bytes, const std::string& label) {
  if (bytes.size() < 10 || bytes.substr(0, 6) != "\x93NUMPY") return Bad(label, "not a .npy file");
  const uint8_t major = static_cast<uint8_t>(bytes[6]);
  size_t header_len = 0, offset = 0;
  if (major == 1) {
    header_len = static_cast<uint8_t>(bytes[8]) | (static_cast<uint8_t>(bytes[9]) << 8);
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return Bad(label, "truncated header");
    uint32_t n;
    std::memcpy(&n, bytes.data() + 8, 4);
    header_len = n;
    offset = 12;
  } else {
    return Bad(label, absl::StrCat("unsupported .npy version ", major));
  }
  if (bytes.size() < offset + header_len) return Bad(label, "truncated header");
  const absl::string_view header = bytes.substr(offset, header_len);
  const std::string descr = HeaderField(header, "descr");
  if (HeaderField(header, "fortran_order") != "False") {
    return Bad(label, "only C-order arrays are read");
  }
  std::string shape = HeaderField(header, "shape");
  shape = std::string(absl::StripSuffix(absl::StripPrefix(shape, "("), ")"));
  std::vector<int64_t> dims;
  for (absl::string_view p : absl::StrSplit(shape, ',', absl::SkipWhitespace())) {
    int64_t v;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(p), &v) || v < 0) {
      return Bad(label, absl::StrCat("bad shape (", shape, ")"));
    }
    dims.push_back(v);
  }
  if (dims.size() != 2) return Bad(label, absl::StrCat("expected a 2-D array, got (", shape, ")"));
  Matrix m;
  m.rows = dims[0];
  m.cols = dims[1];
  if (m.cols > 0 && m.rows > (int64_t{1} << 36) / m.cols) return Bad(label, "array too large");
  const size_t n = static_cast<size_t>(m.rows * m.cols);
  const absl::string_view data = bytes.substr(offset + header_len);
  if (descr == "<f4") {
    if (data.size() != n * 4)
      return Bad(label, absl::StrCat(data.size(), " data bytes, need ", n * 4));
    m.values.resize(n);
    for (size_t i = 0; i < n; ++i) {
      float f;
      std::memcpy(&f, data.data() + 4 * i, 4);
      m.values[i] = Bf16::FromFloat(f);
    }
  } else if (descr == "<u2") {
    if (data.size() != n * 2)
      return Bad(label, absl::StrCat(data.size(), " data bytes, need ", n * 2));
    m.values.resize(n);
    std::memcpy(m.values.data(), data.data(), n * 2);
  } else {
    return Bad(label, absl::StrCat("dtype '", descr, "' not supported (<f4, or <u2 holding bf16)"));
  }
  return m;
}

absl::StatusOr<Matrix> ReadMatrix(const std::string& path, const std::string& tensor_name) {
  if (absl::EndsWith(path, ".safetensors")) {
    MOE_ASSIGN_OR_RETURN(auto file, checkpoint::SafetensorsFile::Open(path));
    const checkpoint::TensorInfo* info = nullptr;
    if (!tensor_name.empty()) {
      info = file->Find(tensor_name);
      if (info == nullptr)
        return absl::NotFoundError(absl::StrCat(path, " has no tensor ", tensor_name));
    } else if (file->tensors().size() == 1) {
      info = &file->tensors()[0];
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(path, " holds ", file->tensors().size(), " tensors: name one (--tensor)"));
    }
    if (info->shape.size() != 2) {
      return Bad(path, absl::StrCat(info->name, " must be 2-D [rows, cols], got ",
                                    checkpoint::ShapeString(info->shape)));
    }
    Matrix m;
    m.rows = info->shape[0];
    m.cols = info->shape[1];
    const absl::Span<const uint8_t> d = file->Data(*info);
    const size_t n = static_cast<size_t>(m.rows * m.cols);
    m.values.resize(n);
    if (info->dtype == tensor::DType::kBF16) {
      std::memcpy(m.values.data(), d.data(), n * 2);
    } else if (info->dtype == tensor::DType::kF32) {
      for (size_t i = 0; i < n; ++i) {
        float f;
        std::memcpy(&f, d.data() + 4 * i, 4);
        m.values[i] = Bf16::FromFloat(f);
      }
    } else {
      return Bad(path, absl::StrCat(info->name, " must be BF16 or F32, got ",
                                    tensor::DTypeName(info->dtype)));
    }
    return m;
  }
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream ss;
  ss << f.rdbuf();
  return ParseNpy(ss.str(), path);
}

absl::Status WriteNpyF32(const std::string& path, const std::vector<float>& values, int64_t rows,
                         int64_t cols) {
  std::string header =
      absl::StrCat("{'descr': '<f4', 'fortran_order': False, 'shape': (", rows, ", ", cols, "), }");
  // Pad so that magic + version + length + header is a multiple of 64, ending in '\n'.
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::ofstream f(path, std::ios::binary);
  if (!f) return absl::InternalError(absl::StrCat("cannot write ", path));
  f.write("\x93NUMPY\x01\x00", 8);
  const uint16_t len = static_cast<uint16_t>(header.size());
  f.put(static_cast<char>(len & 0xff));
  f.put(static_cast<char>(len >> 8));
  f << header;
  f.write(reinterpret_cast<const char*>(values.data()),
          static_cast<std::streamsize>(values.size() * 4));
  if (!f) return absl::InternalError(absl::StrCat("short write to ", path));
  return absl::OkStatus();
}

}  // namespace moe::tools
