// Safetensors reader: mmap of shard files, strict header validation, checkpoint index resolution.
// Owns: the byte-level format checks (header length, JSON types, dtypes, offsets, overlaps) and
// the agreement between model.safetensors.index.json and its shards.
// Must not: interpret tensor names, convert or copy tensor data (views point into the mapping).
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"

namespace k3::io {

namespace {

// std::map-backed JSON (O(log n) lookups even for 100k-entry weight maps); header order is
// recovered separately from the parser's key events.
using Json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // 100 MB, far above any real header
constexpr uint64_t kMaxIndexBytes = 256ull << 20;   // model.safetensors.index.json

std::string errno_text(int e) { return std::string(std::strerror(e)); }

// Makes an untrusted string safe for a one-line message: control bytes escaped, length capped.
std::string printable(std::string_view s) {
  std::string out;
  const size_t cap = 160;
  for (size_t i = 0; i < s.size() && i < cap; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > cap) out += "...";
  return out;
}

std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

std::string tensor_ctx(std::string_view name) { return " (tensor '" + printable(name) + "')"; }

// First pass over JSON text (SAX, no DOM): records the top-level keys in document order and the
// first duplicate key of any object (nlohmann's DOM would silently keep the last one). A SAX pass
// is used because nlohmann's parse callbacks rescan the parent object at every object end, which
// is quadratic for headers with many tensors.
struct KeyScan {
  std::vector<std::set<std::string>> keys;  // one key set per open object
  std::vector<bool> is_object;              // open containers, innermost last
  std::vector<std::string>* top_keys = nullptr;
  std::string duplicate;
  bool top_level_dup = false;
  std::string error;

  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(Json::number_integer_t) { return true; }
  bool number_unsigned(Json::number_unsigned_t) { return true; }
  bool number_float(Json::number_float_t, const Json::string_t&) { return true; }
  bool string(Json::string_t&) { return true; }
  bool binary(Json::binary_t&) { return true; }
  bool start_object(std::size_t) {
    keys.emplace_back();
    is_object.push_back(true);
    return true;
  }
  bool key(Json::string_t& k) {
    if (keys.empty()) return true;
    if (!keys.back().insert(k).second) {
      if (duplicate.empty()) {
        duplicate = k;
        top_level_dup = is_object.size() == 1;
      }
    } else if (top_keys != nullptr && is_object.size() == 1) {
      top_keys->push_back(k);
    }
    return true;
  }
  bool end_object() {
    if (!keys.empty()) keys.pop_back();
    if (!is_object.empty()) is_object.pop_back();
    return true;
  }
  bool start_array(std::size_t) {
    is_object.push_back(false);
    return true;
  }
  bool end_array() {
    if (!is_object.empty()) is_object.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) {
    error = ex.what();
    return false;
  }
};

// Parses JSON text, rejecting syntax errors and duplicate keys in any object. Throws k3::Error
// "<label>: bad JSON ...". When `top_keys` is given it receives the keys of the top-level object
// in document order.
Json parse_json_strict(const char* begin, const char* end, const std::string& label, const char* what,
                       std::vector<std::string>* top_keys = nullptr) {
  KeyScan scan;
  scan.top_keys = top_keys;
  bool ok = false;
  try {
    ok = Json::sax_parse(begin, end, &scan);
  } catch (const std::exception& e) {
    scan.error = e.what();
  }
  if (!ok) {
    if (scan.error.empty()) scan.error = "parse error";
    fail(label + ": bad JSON in " + what + ": " + printable(one_line(scan.error)));
  }
  if (!scan.duplicate.empty()) {
    if (scan.top_level_dup) fail(label + ": duplicate name in " + what + tensor_ctx(scan.duplicate));
    fail(label + ": duplicate key '" + printable(scan.duplicate) + "' in " + what);
  }
  Json j;
  try {
    j = Json::parse(begin, end);
  } catch (const std::exception& e) {
    fail(label + ": bad JSON in " + what + ": " + printable(one_line(e.what())));
  }
  return j;
}

// Reads a JSON non-negative integer that must fit `limit`; false on any other JSON value.
bool get_uint(const Json& v, uint64_t limit, uint64_t& out) {
  if (v.is_number_unsigned()) {
    out = v.get<uint64_t>();
  } else if (v.is_number_integer()) {
    const int64_t s = v.get<int64_t>();
    if (s < 0) return false;
    out = static_cast<uint64_t>(s);
  } else {
    return false;
  }
  return out <= limit;
}

uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

bool path_exists(const std::string& p) {
  std::error_code ec;
  return std::filesystem::exists(p, ec);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// MappedFile

std::unique_ptr<MappedFile> MappedFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path + ": cannot open: " + errno_text(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    fail(path + ": cannot stat: " + errno_text(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path + ": not a regular file");
  }
  std::unique_ptr<MappedFile> m(new MappedFile());
  m->path_ = path;
  m->size_ = static_cast<size_t>(st.st_size);
  if (m->size_ > 0) {
    void* p = ::mmap(nullptr, m->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      fail(path + ": cannot mmap " + std::to_string(m->size_) + " bytes: " + errno_text(e));
    }
    m->data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping stays valid after close
  return m;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

// ---------------------------------------------------------------------------------------------
// Header parsing

SafetensorsHeader parse_safetensors_header(const uint8_t* bytes, size_t available, uint64_t file_size,
                                           const std::string& label) {
  if (file_size < 8 || available < 8 || bytes == nullptr)
    fail(label + ": file too small for a safetensors header (" + std::to_string(file_size) +
         " bytes, need at least 8)");
  const uint64_t n = read_le64(bytes);
  if (n > kMaxHeaderBytes)
    fail(label + ": header length " + std::to_string(n) + " exceeds the " + std::to_string(kMaxHeaderBytes) +
         "-byte limit");
  if (n > file_size - 8)
    fail(label + ": header length " + std::to_string(n) + " beyond file size " + std::to_string(file_size));
  if (available - 8 < n)
    fail(label + ": header truncated (" + std::to_string(available) + " of " + std::to_string(8 + n) +
         " bytes available)");

  const char* text = reinterpret_cast<const char*>(bytes + 8);
  std::vector<std::string> key_order;
  const Json j = parse_json_strict(text, text + n, label, "header", &key_order);
  if (!j.is_object()) fail(label + ": header is not a JSON object");

  SafetensorsHeader h;
  h.data_start = 8 + n;
  const uint64_t data_size = file_size - h.data_start;
  std::vector<uint64_t> ends;

  h.tensors.reserve(key_order.size());
  for (const std::string& name : key_order) {
    const Json& e = j.at(name);
    if (name == "__metadata__") {
      if (!e.is_object()) fail(label + ": __metadata__ is not a JSON object");
      for (const auto& [k, v] : e.items()) {
        if (!v.is_string()) fail(label + ": __metadata__ value is not a string (key '" + printable(k) + "')");
        h.metadata.emplace(k, v.get<std::string>());
      }
      continue;
    }
    const std::string ctx = tensor_ctx(name);
    if (name.empty()) fail(label + ": empty tensor name");
    if (!e.is_object()) fail(label + ": tensor entry is not a JSON object" + ctx);
    for (const auto& [k, v] : e.items()) {
      (void)v;
      if (k != "dtype" && k != "shape" && k != "data_offsets")
        fail(label + ": unexpected key '" + printable(k) + "'" + ctx);
    }
    if (!e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
      fail(label + ": entry needs dtype, shape and data_offsets" + ctx);

    const Json& jd = e["dtype"];
    if (!jd.is_string()) fail(label + ": dtype is not a string" + ctx);
    const std::string& dname = jd.get_ref<const std::string&>();
    const std::optional<DType> dt = dtype_from_name(dname);
    if (!dt) fail(label + ": unknown dtype '" + printable(dname) + "'" + ctx);

    const Json& js = e["shape"];
    if (!js.is_array()) fail(label + ": shape is not an array" + ctx);
    TensorView v;
    v.name = name;
    v.dtype = *dt;
    v.shape.reserve(js.size());
    // Running product checked at every step so TensorView::numel() can never overflow either.
    uint64_t numel = 1;
    constexpr uint64_t kMaxI64 = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    for (const Json& d : js) {
      uint64_t dim = 0;
      if (!get_uint(d, kMaxI64, dim))
        fail(label + ": shape entry " + printable(d.dump()) + " is not a non-negative integer" + ctx);
      if (__builtin_mul_overflow(numel, dim, &numel) || numel > kMaxI64)
        fail(label + ": shape " + printable(js.dump()) + " has too many elements" + ctx);
      v.shape.push_back(static_cast<int64_t>(dim));
    }
    uint64_t nbytes = 0;
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(*dt)), &nbytes))
      fail(label + ": shape " + printable(js.dump()) + " has too many bytes" + ctx);

    const Json& jo = e["data_offsets"];
    uint64_t begin = 0, end = 0;
    if (!jo.is_array() || jo.size() != 2 || !get_uint(jo[0], std::numeric_limits<uint64_t>::max(), begin) ||
        !get_uint(jo[1], std::numeric_limits<uint64_t>::max(), end))
      fail(label + ": data_offsets must be two non-negative integers" + ctx);
    if (begin > end)
      fail(label + ": reversed data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "]" + ctx);
    if (end > data_size)
      fail(label + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
           "] out of range (data section is " + std::to_string(data_size) + " bytes)" + ctx);
    if (end - begin != nbytes)
      fail(label + ": shape " + v.shape_str() + " of " + dname + " needs " + std::to_string(nbytes) +
           " bytes but data_offsets span " + std::to_string(end - begin) + ctx);
    v.nbytes = static_cast<size_t>(nbytes);
    h.tensors.push_back(std::move(v));
    h.offsets.push_back(begin);
    ends.push_back(end);
  }

  // Overlap check: sort by begin; a non-empty tensor must start at or after every earlier end.
  std::vector<size_t> order(h.tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return h.offsets[a] != h.offsets[b] ? h.offsets[a] < h.offsets[b] : ends[a] < ends[b];
  });
  bool have_prev = false;
  size_t prev = 0;
  for (size_t i : order) {
    if (ends[i] == h.offsets[i]) continue;  // empty tensors occupy no bytes
    if (have_prev && h.offsets[i] < ends[prev])
      fail(label + ": tensors overlap in the data section" + tensor_ctx(h.tensors[prev].name) + " and" +
           tensor_ctx(h.tensors[i].name));
    if (!have_prev || ends[i] > ends[prev]) prev = i;
    have_prev = true;
  }
  return h;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  auto f = std::make_unique<SafetensorsFile>();
  f->map_ = MappedFile::open(path);
  f->header_ = parse_safetensors_header(f->map_->data(), f->map_->size(), f->map_->size(), path);
  const uint8_t* data = f->map_->data() + f->header_.data_start;
  for (size_t i = 0; i < f->header_.tensors.size(); ++i) {
    f->header_.tensors[i].data = data + f->header_.offsets[i];
    f->by_name_.emplace(f->header_.tensors[i].name, i);
  }
  return f;
}

SafetensorsHeader SafetensorsFile::read_header(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path + ": cannot open: " + errno_text(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail(path + ": cannot stat: " + errno_text(errno));
  if (!S_ISREG(st.st_mode)) fail(path + ": not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);

  auto read_at = [&](uint8_t* dst, size_t len, uint64_t off) {
    size_t done = 0;
    while (done < len) {
      const ssize_t r = ::pread(fd, dst + done, len - done, static_cast<off_t>(off + done));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) fail(path + ": read error: " + errno_text(errno));
      if (r == 0) fail(path + ": file shrank while reading the header");
      done += static_cast<size_t>(r);
    }
  };
  std::vector<uint8_t> buf(8, 0);
  if (size < 8) return parse_safetensors_header(buf.data(), 0, size, path);  // throws "too small"
  read_at(buf.data(), 8, 0);
  const uint64_t n = read_le64(buf.data());
  if (n > kMaxHeaderBytes || n > size - 8) return parse_safetensors_header(buf.data(), 8, size, path);  // throws
  buf.resize(8 + n);
  read_at(buf.data() + 8, n, 8);
  return parse_safetensors_header(buf.data(), buf.size(), size, path);
}

const TensorView* SafetensorsFile::find(std::string_view name) const {
  auto it = by_name_.find(std::string(name));
  return it == by_name_.end() ? nullptr : &header_.tensors[it->second];
}

// ---------------------------------------------------------------------------------------------
// Checkpoint

namespace {

struct Shard {
  std::string file;  // name as written in the index
  std::string path;  // dir + "/" + file
  std::vector<TensorView> tensors;
  std::unordered_map<std::string, size_t> by_name;
};

struct Loaded {
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::vector<std::string> shard_paths, missing;
  std::vector<TensorView> views;
  bool has_index = false;
};

void load_shard(Shard& s, bool headers_only, std::vector<std::unique_ptr<SafetensorsFile>>& files) {
  if (headers_only) {
    s.tensors = SafetensorsFile::read_header(s.path).tensors;
  } else {
    files.push_back(SafetensorsFile::open(s.path));
    s.tensors = files.back()->tensors();
  }
  for (size_t i = 0; i < s.tensors.size(); ++i) s.by_name.emplace(s.tensors[i].name, i);
}

Loaded load_checkpoint(const std::string& dir, bool headers_only) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) fail(dir + ": not a directory");
  Loaded L;
  const std::string index_path = dir + "/model.safetensors.index.json";
  const std::string single_path = dir + "/model.safetensors";

  if (!path_exists(index_path)) {
    if (!path_exists(single_path)) {
      if (headers_only) return L;  // config-only directory: an empty checkpoint
      fail("no model.safetensors.index.json or model.safetensors in " + dir);
    }
    Shard s{"model.safetensors", single_path, {}, {}};
    load_shard(s, headers_only, L.files);
    L.shard_paths.push_back(single_path);
    L.views = std::move(s.tensors);
    return L;
  }

  // ---- index + shards
  L.has_index = true;
  std::string text;
  {
    auto m = MappedFile::open(index_path);
    if (m->size() > kMaxIndexBytes)
      fail(index_path + ": index is " + std::to_string(m->size()) + " bytes (limit " + std::to_string(kMaxIndexBytes) +
           ")");
    text.assign(reinterpret_cast<const char*>(m->data()), m->size());
  }
  const Json j = parse_json_strict(text.data(), text.data() + text.size(), index_path, "index");
  if (!j.is_object()) fail(index_path + ": index is not a JSON object");
  if (j.contains("metadata") && !j["metadata"].is_object() && !j["metadata"].is_null())
    fail(index_path + ": 'metadata' is not a JSON object");
  if (!j.contains("weight_map") || !j["weight_map"].is_object())
    fail(index_path + ": 'weight_map' is missing or not a JSON object");

  ProblemList problems;
  std::vector<std::pair<std::string, std::string>> mapping;  // tensor -> shard file, index order
  std::unordered_map<std::string, std::string> shard_of;
  std::map<std::string, Shard> shards;  // sorted by file name
  std::set<std::string> bad_files;
  for (const auto& [name, v] : j["weight_map"].items()) {
    if (!v.is_string()) {
      problems.add("weight_map value is not a string" + tensor_ctx(name));
      continue;
    }
    const std::string& file = v.get_ref<const std::string&>();
    const bool unsafe = file.empty() || file.find('/') != std::string::npos || file.find('\\') != std::string::npos ||
                        file.find("..") != std::string::npos || file.find('\0') != std::string::npos;
    if (unsafe) {
      if (bad_files.insert(file).second) problems.add("unsafe shard file name '" + printable(file) + "'");
      continue;
    }
    mapping.emplace_back(name, file);
    shard_of.emplace(name, file);
    if (!shards.count(file)) shards.emplace(file, Shard{file, dir + "/" + file, {}, {}});
  }

  std::set<std::string> loaded;
  for (auto& [file, s] : shards) {
    L.shard_paths.push_back(s.path);
    if (!path_exists(s.path)) {
      if (headers_only) {
        L.missing.push_back(s.path);
      } else {
        problems.add("shard '" + printable(file) + "' named in the index is missing");
      }
      continue;
    }
    try {
      load_shard(s, headers_only, L.files);
      loaded.insert(file);
    } catch (const Error& e) {
      problems.add(e.what());
    }
  }

  for (const auto& [name, file] : mapping) {
    if (!loaded.count(file)) continue;
    const Shard& s = shards.at(file);
    auto it = s.by_name.find(name);
    if (it == s.by_name.end()) {
      problems.add("tensor mapped to shard '" + printable(file) + "' is not in that shard" + tensor_ctx(name));
      continue;
    }
    L.views.push_back(s.tensors[it->second]);
  }
  for (const auto& file : loaded) {
    for (const TensorView& t : shards.at(file).tensors) {
      auto it = shard_of.find(t.name);
      if (it == shard_of.end())
        problems.add("tensor in shard '" + printable(file) + "' is not listed in the index" + tensor_ctx(t.name));
      else if (it->second != file)
        problems.add("tensor in shard '" + printable(file) + "' is mapped by the index to '" + printable(it->second) +
                     "'" + tensor_ctx(t.name));
    }
  }
  problems.throw_if_any(index_path);
  return L;
}

}  // namespace

std::unique_ptr<Checkpoint> Checkpoint::open(const std::string& dir) {
  Loaded L = load_checkpoint(dir, /*headers_only=*/false);
  auto c = std::make_unique<Checkpoint>();
  c->files_ = std::move(L.files);
  c->shard_paths_ = std::move(L.shard_paths);
  c->has_index_ = L.has_index;
  for (TensorView& v : L.views) c->views_.emplace(v.name, std::move(v));
  return c;
}

std::unique_ptr<Checkpoint> Checkpoint::open_headers(const std::string& dir) {
  Loaded L = load_checkpoint(dir, /*headers_only=*/true);
  auto c = std::make_unique<Checkpoint>();
  c->shard_paths_ = std::move(L.shard_paths);
  c->missing_shards_ = std::move(L.missing);
  c->has_index_ = L.has_index;
  for (TensorView& v : L.views) c->views_.emplace(v.name, std::move(v));
  return c;
}

const TensorView* Checkpoint::find(std::string_view name) const {
  auto it = views_.find(std::string(name));
  return it == views_.end() ? nullptr : &it->second;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(views_.size());
  for (const auto& [k, v] : views_) out.push_back(k);
  std::sort(out.begin(), out.end());
  return out;
}

std::map<DType, uint64_t> Checkpoint::bytes_by_dtype() const {
  std::map<DType, uint64_t> out;
  for (const auto& [k, v] : views_) out[v.dtype] += v.nbytes;
  return out;
}

uint64_t Checkpoint::mapped_bytes() const {
  uint64_t n = 0;
  for (const auto& f : files_) n += f->file_size();
  return n;
}

namespace {
// Sorted, merged, non-empty ranges (a page shared by neighbours is then counted and touched once).
std::vector<std::pair<uint64_t, uint64_t>> merged_ranges(std::vector<std::pair<uint64_t, uint64_t>> r) {
  std::sort(r.begin(), r.end());
  std::vector<std::pair<uint64_t, uint64_t>> merged;
  for (const auto& [b, e] : r) {
    if (b >= e) continue;
    if (!merged.empty() && b <= merged.back().second)
      merged.back().second = std::max(merged.back().second, e);
    else
      merged.emplace_back(b, e);
  }
  return merged;
}
}  // namespace

void Checkpoint::prefault(const std::function<void(uint64_t, uint64_t)>& progress,
                          const std::function<bool(std::string_view)>& skip) const {
  // Per file, the byte ranges to read in: everything, or the header plus the kept tensors.
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> ranges(files_.size());
  for (size_t i = 0; i < files_.size(); ++i) {
    const auto& f = files_[i];
    const uint64_t n = f->file_size();
    if (n == 0) continue;
    auto& r = ranges[i];
    if (!skip) {
      r.emplace_back(0, n);
      continue;
    }
    const uint8_t* base = f->mapped_data();
    uint64_t data_start = n;
    for (const TensorView& t : f->tensors()) data_start = std::min<uint64_t>(data_start, uint64_t(t.data - base));
    r.emplace_back(0, data_start);
    for (const TensorView& t : f->tensors())
      if (t.nbytes > 0 && !skip(t.name)) r.emplace_back(uint64_t(t.data - base), uint64_t(t.data - base) + t.nbytes);
    r = merged_ranges(std::move(r));
  }
  touch(ranges, progress);
}

void Checkpoint::prefault_spans(const std::vector<std::pair<const uint8_t*, uint64_t>>& spans,
                                const std::function<void(uint64_t, uint64_t)>& progress) const {
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> ranges(files_.size());
  for (const auto& [p, n] : spans)
    for (size_t i = 0; i < files_.size(); ++i) {
      const uint8_t* base = files_[i]->mapped_data();
      const uint64_t size = files_[i]->file_size();
      if (!base || !p || p < base || p >= base + size) continue;
      const uint64_t off = uint64_t(p - base);
      ranges[i].emplace_back(off, off + std::min(n, size - off));
      break;
    }
  for (auto& r : ranges) r = merged_ranges(std::move(r));
  touch(ranges, progress);
}

void Checkpoint::touch(const std::vector<std::vector<std::pair<uint64_t, uint64_t>>>& ranges,
                       const std::function<void(uint64_t, uint64_t)>& progress) const {
  constexpr uint64_t kStep = uint64_t(64) << 20;
  const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
  uint64_t total = 0;
  for (const auto& r : ranges)
    for (const auto& [b, e] : r) total += e - b;
  uint64_t done = 0, since = 0;
  volatile uint8_t sink = 0;  // keeps the touches from being optimised away
  for (size_t i = 0; i < files_.size(); ++i) {
    const uint8_t* base = files_[i]->mapped_data();
    for (const auto& [b, e] : ranges[i]) {
      // Advice only: a failure (e.g. on a filesystem without readahead) changes speed, not results.
      const uint64_t ab = b / page * page;
      (void)::madvise(const_cast<uint8_t*>(base + ab), size_t(e - ab), MADV_WILLNEED);
      for (uint64_t off = b; off < e; off += kStep) {
        const uint64_t end = std::min(e, off + kStep);
        uint8_t acc = 0;
        // One touch per page: the range's first byte, then every page boundary inside it.
        acc ^= base[off];
        for (uint64_t p = (off / page + 1) * page; p < end; p += page) acc ^= base[p];
        sink = sink ^ acc;
        done += end - off;
        since += end - off;
        if (progress && since >= kStep) {
          progress(done, total);
          since = 0;
        }
      }
    }
  }
  if (progress) progress(done, total);
  (void)sink;
}

std::optional<TensorLocation> Checkpoint::locate(std::string_view name) const {
  const TensorView* t = find(name);
  if (!t || !t->data) return std::nullopt;
  return locate(t->data, t->nbytes);
}

std::optional<TensorLocation> Checkpoint::locate(const uint8_t* data, uint64_t nbytes) const {
  if (!data) return std::nullopt;
  for (size_t i = 0; i < files_.size(); ++i) {
    const uint8_t* base = files_[i]->mapped_data();
    const uint64_t size = files_[i]->file_size();
    if (!base || data < base || data > base + size) continue;
    const uint64_t off = uint64_t(data - base);
    if (nbytes > size - off) return std::nullopt;
    // shard_paths_ lists every shard in the same (sorted) order the files were opened.
    TensorLocation loc;
    loc.shard = i;
    loc.path = files_[i]->path();
    loc.offset = off;
    loc.nbytes = nbytes;
    loc.file_size = size;
    return loc;
  }
  return std::nullopt;
}

uint64_t Checkpoint::total_tensor_bytes() const {
  uint64_t n = 0;
  for (const auto& [k, v] : views_) n += v.nbytes;
  return n;
}

}  // namespace k3::io
