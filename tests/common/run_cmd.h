// Runs the `k3` binary (path from the K3_BIN compile definition) and captures exit code, stdout
// and stderr separately. Test-only.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace k3test {

struct CmdResult {
  int code = -1;
  std::string out, err;
};

inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Runs a shell command line (not necessarily k3) and captures exit code, stdout and stderr.
inline CmdResult run_shell(const std::string& cmdline) {
  static int counter = 0;
  const auto dir = std::filesystem::temp_directory_path();
  const std::string tag = std::to_string(::getpid()) + "_sh" + std::to_string(counter++);
  const auto out = dir / ("k3test_out_" + tag), err = dir / ("k3test_err_" + tag);
  const std::string cmd = "(" + cmdline + ") >" + out.string() + " 2>" + err.string();
  const int st = std::system(cmd.c_str());
  CmdResult r;
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  r.out = slurp(out);
  r.err = slurp(err);
  std::filesystem::remove(out);
  std::filesystem::remove(err);
  return r;
}

// `args` is appended to the binary path verbatim (the caller quotes).
inline CmdResult run_k3(const std::string& args) { return run_shell(std::string(K3_BIN) + " " + args); }

inline std::string quote(const std::string& s) { return "'" + s + "'"; }

// A path in the source tree, "-m '<source>/rel'" for a model in it, and a scratch file name unique
// to this test process (prefix names the test file).
inline std::filesystem::path source_path(const std::string& rel) { return std::filesystem::path(K3_SOURCE_DIR) / rel; }
inline std::string model_flag(const std::string& rel) { return "-m " + quote(source_path(rel).string()); }
inline std::filesystem::path temp_path(const std::string& prefix, const std::string& name) {
  return std::filesystem::temp_directory_path() / (prefix + "_" + std::to_string(::getpid()) + "_" + name);
}

}  // namespace k3test
