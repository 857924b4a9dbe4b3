#include "services/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "services/common/status_macros.h"

namespace moe::checkpoint {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kMaxDim = uint64_t{1} << 40;

uint64_t ReadLe64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

absl::Status Corrupt(const std::string& label, absl::string_view what) {
  return absl::DataLossError(absl::StrCat(label, ": ", what));
}

absl::Status TensorError(const std::string& label, absl::string_view tensor,
                         absl::string_view what) {
  return absl::DataLossError(absl::StrCat(label, ": tensor \"", tensor, "\": ", what));
}

std::string ErrnoText() { return std::strerror(errno); }

// One tensor's header entry: dtype, shape and data offsets, each checked (sizes against the
// dtype and shape, offsets inside the data section of data_size bytes).
absl::StatusOr<TensorInfo> ParseEntry(const std::string& label, const std::string& name,
                                      const Json& entry, uint64_t data_size) {
  if (!entry.is_object()) return TensorError(label, name, "entry is not an object");
  TensorInfo info;
  info.name = name;
  auto dtype = entry.find("dtype");
  if (dtype == entry.end() || !dtype->is_string()) {
    return TensorError(label, name, "missing or non-string \"dtype\"");
  }
  auto parsed = tensor::ParseDType(dtype->get<std::string>());
  if (!parsed.ok()) return TensorError(label, name, parsed.status().message());
  info.dtype = *parsed;
  auto shape = entry.find("shape");
  if (shape == entry.end() || !shape->is_array()) {
    return TensorError(label, name, "missing or non-array \"shape\"");
  }
  unsigned __int128 elements = 1;
  for (const Json& d : *shape) {
    if (!d.is_number_unsigned()) {
      return TensorError(label, name,
                         absl::StrCat("shape entry ", d.dump(), " is not a non-negative integer"));
    }
    const uint64_t dim = d.get<uint64_t>();
    if (dim > kMaxDim) {
      return TensorError(label, name, absl::StrCat("shape entry ", dim, " is too large"));
    }
    info.shape.push_back(static_cast<int64_t>(dim));
    elements *= dim;
    if (elements > (static_cast<unsigned __int128>(1) << 62)) {
      return TensorError(label, name, "shape has too many elements");
    }
  }
  auto offsets = entry.find("data_offsets");
  if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 ||
      !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
    return TensorError(label, name, "\"data_offsets\" must be two non-negative integers");
  }
  info.begin = (*offsets)[0].get<uint64_t>();
  info.end = (*offsets)[1].get<uint64_t>();
  if (info.begin > info.end) {
    return TensorError(
        label, name, absl::StrCat("data_offsets [", info.begin, ", ", info.end, "] are reversed"));
  }
  const unsigned __int128 want = elements * tensor::DTypeSize(info.dtype);
  if (want != info.end - info.begin) {
    return TensorError(
        label, name,
        absl::StrCat("holds ", info.end - info.begin, " bytes but ", tensor::DTypeName(info.dtype),
                     " ", ShapeString(info.shape), " needs ", static_cast<uint64_t>(want)));
  }
  if (info.end > data_size) {
    return TensorError(
        label, name,
        absl::StrCat("data_offsets [", info.begin, ", ", info.end, "] run past the end of the ",
                     data_size, "-byte data section (truncated?)"));
  }
  return info;
}

// No two non-empty byte ranges overlap.
absl::Status CheckNoOverlap(const std::string& label, const std::vector<TensorInfo>& tensors) {
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return tensors[a].begin != tensors[b].begin ? tensors[a].begin < tensors[b].begin
                                                : tensors[a].end < tensors[b].end;
  });
  const TensorInfo* prev = nullptr;
  for (size_t i : order) {
    const TensorInfo& t = tensors[i];
    if (t.begin == t.end) continue;
    if (prev != nullptr && t.begin < prev->end) {
      return TensorError(label, t.name,
                         absl::StrCat("bytes [", t.begin, ", ", t.end, ") overlap tensor \"",
                                      prev->name, "\" [", prev->begin, ", ", prev->end, ")"));
    }
    prev = &t;
  }
  return absl::OkStatus();
}

}  // namespace

int64_t TensorInfo::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int64_t TensorSpec::NumBytes() const {
  int64_t n = static_cast<int64_t>(tensor::DTypeSize(dtype));
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<std::shared_ptr<const SafetensorsFile>> SafetensorsFile::Open(
    const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return absl::PermissionDeniedError(absl::StrCat(path, ": cannot open: ", ErrnoText()));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  std::shared_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->label_ = path;
  file->size_ = static_cast<uint64_t>(st.st_size);
  if (file->size_ > 0) {
    void* m = ::mmap(nullptr, file->size_, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
      ::close(fd);
      return absl::ResourceExhaustedError(absl::StrCat(path, ": mmap failed: ", ErrnoText()));
    }
    file->mapping_ = m;
    file->base_ = static_cast<const uint8_t*>(m);
  }
  ::close(fd);
  MOE_RETURN_IF_ERROR(file->Parse());
  return std::shared_ptr<const SafetensorsFile>(std::move(file));
}

absl::StatusOr<std::shared_ptr<const SafetensorsFile>> SafetensorsFile::FromBytes(
    std::string bytes, std::string label) {
  std::shared_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->label_ = std::move(label);
  file->owned_ = std::move(bytes);
  file->base_ = reinterpret_cast<const uint8_t*>(file->owned_.data());
  file->size_ = file->owned_.size();
  MOE_RETURN_IF_ERROR(file->Parse());
  return std::shared_ptr<const SafetensorsFile>(std::move(file));
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, size_);
}

const TensorInfo* SafetensorsFile::Find(absl::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::Span<const uint8_t> SafetensorsFile::Data(const TensorInfo& info) const {
  return absl::Span<const uint8_t>(base_ + data_start_ + info.begin, info.end - info.begin);
}

absl::Status SafetensorsFile::Parse() {
  if (size_ < 8) {
    return Corrupt(label_, absl::StrCat("file is ", size_,
                                        " bytes; a safetensors file starts with an 8-byte header "
                                        "length (truncated?)"));
  }
  const uint64_t header_len = ReadLe64(base_);
  if (header_len > kMaxHeaderBytes) {
    return Corrupt(label_, absl::StrCat("header length ", header_len, " exceeds the limit of ",
                                        kMaxHeaderBytes, " bytes (not a safetensors file?)"));
  }
  if (header_len > size_ - 8) {
    return Corrupt(label_, absl::StrCat("header length ", header_len, " runs past the end of the ",
                                        size_, "-byte file (truncated?)"));
  }
  if (header_len < 2) return Corrupt(label_, "header is too short to hold a JSON object");
  data_start_ = 8 + header_len;
  const uint64_t data_size = size_ - data_start_;

  // Reject duplicate tensor names: JSON parsers keep the last duplicate silently.
  std::set<std::string> seen;
  std::string duplicate;
  Json::parser_callback_t on_event = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::key && depth == 1 && parsed.is_string()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };
  const char* text = reinterpret_cast<const char*>(base_ + 8);
  Json header = Json::parse(text, text + header_len, on_event, /*allow_exceptions=*/false);
  if (header.is_discarded()) return Corrupt(label_, "header is not valid JSON");
  if (!header.is_object()) return Corrupt(label_, "header JSON is not an object");
  if (!duplicate.empty()) {
    return TensorError(label_, duplicate, "appears more than once in the header");
  }

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const Json& entry = it.value();
    if (name == "__metadata__") {
      if (!entry.is_object()) return Corrupt(label_, "__metadata__ is not an object");
      for (auto m = entry.begin(); m != entry.end(); ++m) {
        if (!m.value().is_string()) {
          return Corrupt(label_,
                         absl::StrCat("__metadata__ value of \"", m.key(), "\" is not a string"));
        }
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    MOE_ASSIGN_OR_RETURN(TensorInfo info, ParseEntry(label_, name, entry, data_size));
    tensors_.push_back(std::move(info));
  }

  MOE_RETURN_IF_ERROR(CheckNoOverlap(label_, tensors_));
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, std::vector<TensorSpec> specs,
    const std::map<std::string, std::string>& metadata) {
  std::stable_sort(specs.begin(), specs.end(), [](const TensorSpec& a, const TensorSpec& b) {
    return tensor::DTypeSize(a.dtype) > tensor::DTypeSize(b.dtype);
  });
  std::unique_ptr<SafetensorsWriter> w(new SafetensorsWriter());
  w->path_ = path;
  Json header = Json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const TensorSpec& spec : specs) {
    if (w->index_.count(spec.name) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor \"", spec.name, "\" is listed twice"));
    }
    TensorInfo info{spec.name, spec.dtype, spec.shape, offset,
                    offset + static_cast<uint64_t>(spec.NumBytes())};
    offset = info.end;
    header[spec.name] = {{"dtype", tensor::DTypeName(spec.dtype)},
                         {"shape", spec.shape},
                         {"data_offsets", {info.begin, info.end}}};
    w->index_[spec.name] = w->layout_.size();
    w->layout_.push_back(std::move(info));
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');  // keeps the data section 8-byte aligned
  w->data_start_ = 8 + text.size();
  w->file_bytes_ = w->data_start_ + offset;
  w->written_.assign(w->layout_.size(), false);

  w->fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd_ < 0) {
    return absl::PermissionDeniedError(absl::StrCat(path, ": cannot create: ", ErrnoText()));
  }
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(text.size() >> (8 * i));
  if (::pwrite(w->fd_, len, 8, 0) != 8 ||
      ::pwrite(w->fd_, text.data(), text.size(), 8) != static_cast<ssize_t>(text.size()) ||
      ::ftruncate(w->fd_, static_cast<off_t>(w->file_bytes_)) != 0) {
    return absl::DataLossError(absl::StrCat(path, ": cannot write header: ", ErrnoText()));
  }
  return w;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status SafetensorsWriter::Write(absl::string_view name, absl::Span<const uint8_t> bytes) {
  auto it = index_.find(std::string(name));
  if (it == index_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": no tensor \"", name, "\" in this file's layout"));
  }
  const TensorInfo& info = layout_[it->second];
  if (bytes.size() != info.end - info.begin) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor \"", name, "\" needs ",
                                                   info.end - info.begin, " bytes, got ",
                                                   bytes.size()));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (written_[it->second]) {
      return absl::FailedPreconditionError(
          absl::StrCat(path_, ": tensor \"", name, "\" written twice"));
    }
    written_[it->second] = true;
  }
  uint64_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::pwrite(fd_, bytes.data() + done, bytes.size() - done,
                               static_cast<off_t>(data_start_ + info.begin + done));
    if (n <= 0) {
      return absl::DataLossError(absl::StrCat(path_, ": writing \"", name, "\": ", ErrnoText()));
    }
    done += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Finish() {
  for (size_t i = 0; i < layout_.size(); ++i) {
    if (!written_[i]) {
      return absl::FailedPreconditionError(
          absl::StrCat(path_, ": tensor \"", layout_[i].name, "\" was never written"));
    }
  }
  if (::close(fd_) != 0) {
    fd_ = -1;
    return absl::DataLossError(absl::StrCat(path_, ": close failed: ", ErrnoText()));
  }
  fd_ = -1;
  return absl::OkStatus();
}

absl::Status WriteSafetensors(
    const std::string& path,
    const std::vector<std::pair<TensorSpec, std::vector<uint8_t>>>& tensors,
    const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  for (const auto& t : tensors) specs.push_back(t.first);
  MOE_ASSIGN_OR_RETURN(auto writer, SafetensorsWriter::Create(path, specs, metadata));
  for (const auto& t : tensors) MOE_RETURN_IF_ERROR(writer->Write(t.first.name, t.second));
  return writer->Finish();
}

}  // namespace moe::checkpoint
