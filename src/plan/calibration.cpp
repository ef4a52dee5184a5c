// Calibration file schema, strict reader and writer (see calibration.h).
// Must not: fill in a missing rate; a part that is present must be complete.
#include "plan/calibration.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"

namespace k3::plan {

namespace {

using Json = nlohmann::ordered_json;

class Reader {
 public:
  Reader(const Json& j, std::string where, std::string file)
      : j_(j), where_(std::move(where)), file_(std::move(file)) {}
  [[noreturn]] void bad(const std::string& key, const std::string& why) const {
    fail(file_ + ": " + where_ + "." + key + " " + why);
  }
  double rate(const std::string& key) const {
    if (!j_.contains(key)) bad(key, "is missing");
    if (!j_[key].is_number()) bad(key, "must be a number");
    const double v = j_[key].get<double>();
    if (!std::isfinite(v) || v <= 0) bad(key, "must be positive, got " + j_[key].dump());
    return v;
  }
  int64_t count(const std::string& key) const {
    if (!j_.contains(key) || !j_[key].is_number_integer()) bad(key, "must be a whole number");
    const int64_t v = j_[key].get<int64_t>();
    if (v < 1) bad(key, "must be >= 1, got " + std::to_string(v));
    return v;
  }
  std::string text(const std::string& key, bool required) const {
    if (!j_.contains(key)) {
      if (required) bad(key, "is missing");
      return "";
    }
    if (!j_[key].is_string()) bad(key, "must be a string");
    return j_[key].get<std::string>();
  }

 private:
  const Json& j_;
  std::string where_, file_;
};

}  // namespace

Calibration read_calibration(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(path + ": calibration file not found or unreadable");
  std::stringstream ss;
  ss << in.rdbuf();
  const Json j = Json::parse(ss.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) fail(path + ": not a JSON object (a k3 plan calibration file)");
  if (!j.contains("k3_calibration") || !j["k3_calibration"].is_number_integer())
    fail(path + ": not a k3 plan calibration file (no \"k3_calibration\" version)");
  if (j["k3_calibration"].get<int>() != kCalibrationVersion)
    fail(path + ": calibration version " + j["k3_calibration"].dump() + " (this k3 reads version " +
         std::to_string(kCalibrationVersion) + ")");
  Calibration c;
  c.file = path;
  const Reader top(j, "calibration", path);
  c.label = top.text("label", true);
  c.date = top.text("date", false);
  c.command = top.text("command", false);
  c.machine = top.text("machine", false);
  const auto part = [&](const char* name) -> const Json* {
    if (!j.contains(name) || j[name].is_null()) return nullptr;
    if (!j[name].is_object()) fail(path + ": " + name + " must be an object or null");
    return &j[name];
  };
  if (const Json* p = part("cpu")) {
    const Reader r(*p, "cpu", path);
    CpuCalibration x;
    x.threads = int(r.count("threads"));
    x.isa = r.text("isa", false);
    x.numerics = r.text("numerics", false);
    x.expert_gemv_Bps = r.rate("expert_gemv_Bps");
    if (p->contains("expert_gemv_f32_Bps")) x.expert_gemv_f32_Bps = r.rate("expert_gemv_f32_Bps");  // (newer files)
    x.expert_gemm_flops = r.rate("expert_gemm_flops");
    x.expert_gemm_rows = r.count("expert_gemm_rows");
    x.bf16_gemv_Bps = r.rate("bf16_gemv_Bps");
    x.bf16_gemm_flops = r.rate("bf16_gemm_flops");
    x.mem_read_Bps = r.rate("mem_read_Bps");
    x.mem_copy_Bps = r.rate("mem_copy_Bps");
    c.cpu = x;
  }
  if (const Json* p = part("disk")) {
    const Reader r(*p, "disk", path);
    DiskCalibration x;
    x.seq_read_Bps = r.rate("seq_read_Bps");
    x.method = r.text("method", true);
    x.path = r.text("path", false);
    x.file_bytes = uint64_t(r.count("file_bytes"));
    x.note = r.text("note", false);
    c.disk = x;
  }
  if (const Json* p = part("gpu")) {
    const Reader r(*p, "gpu", path);
    GpuCalibration x;
    x.name = r.text("name", true);
    x.table_name = r.text("table_name", false);
    if (p->contains("hbm_bytes") && !(*p)["hbm_bytes"].is_null()) x.hbm_bytes = uint64_t(r.count("hbm_bytes"));
    x.hbm_copy_Bps = r.rate("hbm_copy_Bps");
    x.trunk_gemv_Bps = r.rate("trunk_gemv_Bps");
    x.expert_gemv_Bps = r.rate("expert_gemv_Bps");
    x.decode_flops = r.rate("decode_flops");
    x.gemm_flops = r.rate("gemm_flops");
    x.expert_gemm_flops = r.rate("expert_gemm_flops");
    const bool h2d = p->contains("pcie_h2d_Bps") && !(*p)["pcie_h2d_Bps"].is_null();
    const bool d2h = p->contains("pcie_d2h_Bps") && !(*p)["pcie_d2h_Bps"].is_null();
    if (h2d != d2h) fail(path + ": gpu.pcie_h2d_Bps and gpu.pcie_d2h_Bps come together (both or neither)");
    if (h2d) {
      x.pcie_h2d_Bps = r.rate("pcie_h2d_Bps");
      x.pcie_d2h_Bps = r.rate("pcie_d2h_Bps");
    }
    if (p->contains("layer_s") && !(*p)["layer_s"].is_null()) {
      const Json& v = (*p)["layer_s"];
      if (!v.is_number() || !(v.get<double>() >= 0) || v.get<double>() > 1)
        fail(path + ": gpu.layer_s must be a number of seconds in [0, 1]");
      x.layer_s = v.get<double>();
    }
    if (p->contains("handoff_s") && !(*p)["handoff_s"].is_null()) {
      const Json& v = (*p)["handoff_s"];
      if (!v.is_number() || !(v.get<double>() >= 0) || v.get<double>() > 1)
        fail(path + ": gpu.handoff_s must be a number of seconds in [0, 1]");
      x.handoff_s = v.get<double>();
    }
    c.gpu = x;
  }
  if (!c.cpu && !c.disk && !c.gpu) fail(path + ": the calibration has no cpu, disk or gpu part");
  if (j.contains("sources")) {
    if (!j["sources"].is_object()) fail(path + ": sources must be an object of strings");
    for (const auto& [k, v] : j["sources"].items()) {
      if (!v.is_string()) fail(path + ": sources." + k + " must be a string");
      c.sources[k] = v.get<std::string>();
    }
  }
  return c;
}

std::string calibration_json(const Calibration& c) {
  Json j;
  j["k3_calibration"] = kCalibrationVersion;
  j["label"] = c.label;
  j["date"] = c.date;
  j["command"] = c.command;
  j["machine"] = c.machine;
  if (c.cpu) {
    const CpuCalibration& x = *c.cpu;
    j["cpu"] = {{"threads", x.threads},
                {"isa", x.isa},
                {"numerics", x.numerics},
                {"expert_gemv_Bps", x.expert_gemv_Bps},
                {"expert_gemm_flops", x.expert_gemm_flops},
                {"expert_gemm_rows", x.expert_gemm_rows},
                {"bf16_gemv_Bps", x.bf16_gemv_Bps},
                {"bf16_gemm_flops", x.bf16_gemm_flops},
                {"mem_read_Bps", x.mem_read_Bps},
                {"mem_copy_Bps", x.mem_copy_Bps}};
    if (x.expert_gemv_f32_Bps > 0) j["cpu"]["expert_gemv_f32_Bps"] = x.expert_gemv_f32_Bps;
  } else {
    j["cpu"] = nullptr;
  }
  if (c.disk) {
    const DiskCalibration& x = *c.disk;
    j["disk"] = {{"seq_read_Bps", x.seq_read_Bps},
                 {"method", x.method},
                 {"path", x.path},
                 {"file_bytes", x.file_bytes},
                 {"note", x.note}};
  } else {
    j["disk"] = nullptr;
  }
  if (c.gpu) {
    const GpuCalibration& x = *c.gpu;
    j["gpu"] = {{"name", x.name},
                {"table_name", x.table_name},
                {"hbm_bytes", x.hbm_bytes > 0 ? Json(x.hbm_bytes) : Json(nullptr)},
                {"hbm_copy_Bps", x.hbm_copy_Bps},
                {"trunk_gemv_Bps", x.trunk_gemv_Bps},
                {"expert_gemv_Bps", x.expert_gemv_Bps},
                {"decode_flops", x.decode_flops},
                {"gemm_flops", x.gemm_flops},
                {"expert_gemm_flops", x.expert_gemm_flops}};
    if (x.pcie_h2d_Bps > 0) {
      j["gpu"]["pcie_h2d_Bps"] = x.pcie_h2d_Bps;
      j["gpu"]["pcie_d2h_Bps"] = x.pcie_d2h_Bps;
    } else {
      j["gpu"]["pcie_h2d_Bps"] = nullptr;
      j["gpu"]["pcie_d2h_Bps"] = nullptr;
    }
    j["gpu"]["layer_s"] = x.layer_s >= 0 ? Json(x.layer_s) : Json(nullptr);
    j["gpu"]["handoff_s"] = x.handoff_s >= 0 ? Json(x.handoff_s) : Json(nullptr);
  } else {
    j["gpu"] = nullptr;
  }
  Json src = Json::object();
  for (const auto& [k, v] : c.sources) src[k] = v;
  j["sources"] = src;
  return j.dump(2) + "\n";
}

void write_calibration(const Calibration& c, const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p(path);
  if (p.has_parent_path()) fs::create_directories(p.parent_path(), ec);
  if (ec) fail("cannot create the directory of " + path + ": " + ec.message());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) fail("cannot write the calibration file " + path);
  out << calibration_json(c);
  out.close();
  if (!out) fail("write error on the calibration file " + path);
}

std::string default_calibration_path() {
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/k3/calibration.json";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/k3/calibration.json";
  fail("neither XDG_CACHE_HOME nor HOME is set: pass --out FILE");
}

}  // namespace k3::plan
