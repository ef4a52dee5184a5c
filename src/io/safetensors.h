// Safetensors reading: strict header validation and zero-copy mmap of the data section.
// Owns: the file format (8-byte LE header length, JSON header, data), shard index resolution.
// Must not: know tensor names of any model or convert data; views point into the mapping.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"

namespace k3::io {

// Read-only memory mapping of a whole file (RAII). Throws k3::Error naming the path on failure.
class MappedFile {
 public:
  static std::unique_ptr<MappedFile> open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile() = default;
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

struct SafetensorsHeader {
  std::vector<TensorView> tensors;              // header order; data = nullptr, nbytes set
  std::vector<uint64_t> offsets;                // data_offsets begin, relative to the data section
  std::map<std::string, std::string> metadata;  // "__metadata__"
  uint64_t data_start = 0;                      // 8 + header length
};

// Parses and validates a safetensors image held in memory (the whole file or at least its header
// when `file_size` says how big the file is). Every defect is a k3::Error starting with `label`:
// header length beyond the file, invalid JSON, unknown dtype, shape/byte-count mismatch, offsets
// out of range / reversed / overlapping, duplicate names. Never crashes on any input (fuzzed).
SafetensorsHeader parse_safetensors_header(const uint8_t* bytes, size_t available, uint64_t file_size,
                                           const std::string& label);

// One mapped .safetensors file with its views.
class SafetensorsFile {
 public:
  static std::unique_ptr<SafetensorsFile> open(const std::string& path);
  // Reads only the header (no mmap of the data); views have data == nullptr.
  static SafetensorsHeader read_header(const std::string& path);

  const std::string& path() const { return map_->path(); }
  const std::vector<TensorView>& tensors() const { return header_.tensors; }
  const TensorView* find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  size_t file_size() const { return map_->size(); }
  const uint8_t* mapped_data() const { return map_->data(); }

 private:
  std::unique_ptr<MappedFile> map_;
  SafetensorsHeader header_;
  std::unordered_map<std::string, size_t> by_name_;
};

// Where a tensor's bytes live on disk, for reading them without the mapping (streamed experts).
struct TensorLocation {
  size_t shard = 0;     // index into Checkpoint::shard_paths()
  std::string path;     // the shard file
  uint64_t offset = 0;  // absolute byte offset in the file
  uint64_t nbytes = 0;
  uint64_t file_size = 0;  // the shard's size when it was mapped (a later size means it changed)
};

// A checkpoint directory: `model.safetensors.index.json` + shards, or one `model.safetensors`.
// The index's weight_map must agree with the shards: a name mapped to a shard that lacks it, a
// shard file that is missing, or a tensor present in two shards is an error listing every problem.
class Checkpoint {
 public:
  static std::unique_ptr<Checkpoint> open(const std::string& dir);
  // Headers only (for `k3 info`): shards that are absent are reported in missing_shards() instead
  // of failing; tensors of those shards are unknown.
  static std::unique_ptr<Checkpoint> open_headers(const std::string& dir);

  const TensorView* find(std::string_view name) const;  // nullptr if absent
  std::vector<std::string> names() const;               // sorted
  size_t tensor_count() const { return views_.size(); }
  const std::vector<std::string>& shard_paths() const { return shard_paths_; }
  const std::vector<std::string>& missing_shards() const { return missing_shards_; }
  std::map<DType, uint64_t> bytes_by_dtype() const;
  uint64_t total_tensor_bytes() const;
  bool has_index() const { return has_index_; }
  // Reads every mapped page once (madvise WILLNEED + one touch per page) so the first tokens do not
  // stall on page faults. progress(done_bytes, total_bytes) is called every 64 MiB and at the end.
  // With `skip`, tensors for which skip(name) is true are not touched (nor advised): only headers
  // and the other tensors are read in, and the byte counts cover only those.
  void prefault(const std::function<void(uint64_t, uint64_t)>& progress,
                const std::function<bool(std::string_view)>& skip = {}) const;
  // The same for the given byte spans of the mapping only (e.g. the rows and experts one rank of a
  // split model reads); spans outside every shard's mapping are ignored.
  void prefault_spans(const std::vector<std::pair<const uint8_t*, uint64_t>>& spans,
                      const std::function<void(uint64_t, uint64_t)>& progress) const;
  // The shard file, absolute offset and size of a tensor (open() checkpoints only; nullopt when
  // absent). The address form locates bytes of a view's mapping, e.g. WeightMat::data.
  std::optional<TensorLocation> locate(std::string_view name) const;
  std::optional<TensorLocation> locate(const uint8_t* data, uint64_t nbytes) const;
  uint64_t mapped_bytes() const;  // sum of shard file sizes

 private:
  // Reads in ranges[file] (sorted, merged byte ranges of each shard), with progress.
  void touch(const std::vector<std::vector<std::pair<uint64_t, uint64_t>>>& ranges,
             const std::function<void(uint64_t, uint64_t)>& progress) const;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<std::string> shard_paths_, missing_shards_;
  std::unordered_map<std::string, TensorView> views_;
  bool has_index_ = false;
};

}  // namespace k3::io
