// The `k3` command contract (logits / generate / info) and its bad-input behaviour: every bad
// input is one line naming the problem on stderr and exit code 2, never a crash.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/run_cmd.h"

namespace fs = std::filesystem;
using k3test::quote;
using k3test::run_k3;

namespace {

fs::path tp_tiny() { return fs::path(K3_SHARED_DIR) / "fixtures/third-party/kimi-k3-in-c-tiny"; }
fs::path config_only() { return fs::path(K3_SOURCE_DIR) / "tests/fixtures/k3-config-only"; }

std::string join(const std::vector<int>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + std::to_string(v[i]);
  return s;
}

nlohmann::json expected() {
  std::ifstream f(tp_tiny() / "expected.json");
  return nlohmann::json::parse(f);
}

// A scratch copy of the third-party tiny checkpoint whose header/config can be edited.
struct ScratchModel {
  fs::path dir;
  explicit ScratchModel(const std::string& tag) {
    dir = fs::temp_directory_path() / ("k3cli_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    fs::copy_file(tp_tiny() / "config.json", dir / "config.json");
    fs::copy_file(tp_tiny() / "model.safetensors", dir / "model.safetensors");
    fs::permissions(dir / "model.safetensors", fs::perms::owner_write, fs::perm_options::add);
    fs::permissions(dir / "config.json", fs::perms::owner_write, fs::perm_options::add);
  }
  ~ScratchModel() { fs::remove_all(dir); }
  // Replaces `from` by `to` (same length, so offsets stay valid) inside the safetensors header.
  void edit_header(const std::string& from, const std::string& to) {
    ASSERT_EQ(from.size(), to.size());
    std::fstream f(dir / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    uint64_t n = 0;
    f.read(reinterpret_cast<char*>(&n), 8);
    std::string h(n, '\0');
    f.read(h.data(), std::streamsize(n));
    const auto pos = h.find(from);
    ASSERT_NE(pos, std::string::npos) << from;
    h.replace(pos, from.size(), to);
    f.seekp(8);
    f.write(h.data(), std::streamsize(n));
  }
  void edit_config(const std::function<void(nlohmann::json&)>& fn) {
    nlohmann::json j;
    {
      std::ifstream f(dir / "config.json");
      j = nlohmann::json::parse(f);
    }
    fn(j);
    std::ofstream(dir / "config.json") << j.dump(1);
  }
  std::string m() const { return "--model " + quote(dir.string()); }
};

void expect_bad(const k3test::CmdResult& r, const std::string& fragment) {
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find(fragment), std::string::npos) << "stderr was: " << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "want exactly one line: " << r.err;
}

#define NEED_SHARED() \
  if (!fs::exists(tp_tiny())) GTEST_SKIP() << "../shared third-party fixtures absent: " << tp_tiny()

}  // namespace

TEST(Cli, GenerateReproducesThirdPartyGreedy) {
  NEED_SHARED();
  const auto e = expected();
  const auto prompt = e["prompt_ids"].get<std::vector<int>>(), full = e["full_ids"].get<std::vector<int>>();
  const std::vector<int> want(full.begin() + std::ptrdiff_t(prompt.size()), full.end());
  for (const char* algo : {"--kda chunked --mla absorbed", "--kda recurrent --mla expanded"}) {
    const auto r = run_k3("generate --model " + quote(tp_tiny().string()) + " --ids " + join(prompt, ",") + " -n " +
                          std::to_string(want.size()) + " --greedy --print-ids " + algo);
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(r.out, join(want, " ") + "\n") << algo;
  }
}

TEST(Cli, LogitsTeacherForcedArgmaxAndHead) {
  NEED_SHARED();
  const auto e = expected();
  const auto full = e["full_ids"].get<std::vector<int>>();
  const fs::path ids = fs::temp_directory_path() / ("k3cli_ids_" + std::to_string(::getpid()));
  const fs::path out = fs::temp_directory_path() / ("k3cli_logits_" + std::to_string(::getpid()));
  std::ofstream(ids) << join(full, "\n ,");  // @file form, mixed separators
  const auto r =
      run_k3("logits --model " + quote(tp_tiny().string()) + " --ids @" + ids.string() + " --out " + out.string());
  ASSERT_EQ(r.code, 0) << r.err;
  const size_t T = full.size(), V = 256;
  ASSERT_EQ(fs::file_size(out), T * V * 4);
  std::vector<float> l(T * V);
  std::ifstream(out, std::ios::binary).read(reinterpret_cast<char*>(l.data()), std::streamsize(l.size() * 4));
  for (size_t t = 0; t < T; ++t) {
    EXPECT_EQ(std::max_element(l.begin() + std::ptrdiff_t(t * V), l.begin() + std::ptrdiff_t((t + 1) * V)) -
                  (l.begin() + std::ptrdiff_t(t * V)),
              e["tf_pred"][t].get<int>());
    for (size_t j = 0; j < 8; ++j) EXPECT_NEAR(l[t * V + j], e["logits_head"][t][j].get<double>(), 1e-4);
  }
  fs::remove(ids);
  fs::remove(out);
}

TEST(Cli, InfoOnRealK3ConfigOnly) {
  const auto r = run_k3("info --model " + quote(config_only().string()) + " --ctx 1048576");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* s : {"2,779,484,478,208", "27,648", "434,110,464", "28,991,029,248"})
    EXPECT_NE(r.out.find(s), std::string::npos) << s << " missing from:\n" << r.out;
  EXPECT_NE(r.out.find("104.1"), std::string::npos) << "active ≈104.19B missing:\n" << r.out;
  EXPECT_NE(r.out.find("input: text only (this engine does not implement the vision tower"), std::string::npos)
      << r.out;
}

TEST(Cli, InfoOnTinyReportsWeightBytes) {
  NEED_SHARED();
  const auto r = run_k3("info --model " + quote(tp_tiny().string()));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("F32"), std::string::npos) << r.out;
}

TEST(CliBadInput, MissingModelDir) {
  expect_bad(run_k3("logits --model /nonexistent/k3 --ids 1 --out /tmp/x"), "/nonexistent/k3");
}

TEST(CliBadInput, BadFlagsAndIds) {
  NEED_SHARED();
  const std::string m = "--model " + quote(tp_tiny().string());
  expect_bad(run_k3("generate " + m + " --ids 1,2 -n 2 --bogus"), "k3 generate: error: ");
  expect_bad(run_k3("generate " + m + " --ids 1,2 -n 2 --bogus"), "bogus");
  expect_bad(run_k3("generate " + m + " --ids 1,x,3 -n 2 --greedy"), "'x' is not a token id");
  expect_bad(run_k3("generate " + m + " --ids 1,-3 -n 2 --greedy"), "'-3' is not a token id");
  expect_bad(run_k3("generate " + m + " --ids 1,999 -n 2 --greedy"),
             "token id 999 at position 1 is outside the vocabulary");
  expect_bad(run_k3("logits " + m + " --ids @/nonexistent/ids --out /tmp/x"), "cannot read ids file");
  expect_bad(run_k3("logits " + m + " --ids ' , ' --out /tmp/x"), "no token ids");
  expect_bad(run_k3("logits " + m + " --ids 1 --kda magic --out /tmp/x"), "magic");
  expect_bad(run_k3("frobnicate"), "frobnicate");
}

TEST(CliBadInput, MissingAndExtraTensorAreBothNamed) {
  NEED_SHARED();
  ScratchModel s("rename");
  s.edit_header("layers.1.self_attn.q_proj.weight", "layers.1.self_attn.x_proj.weight");
  const auto r = run_k3("logits " + s.m() + " --ids 1,2 --out /tmp/k3_unused");
  expect_bad(r, "missing tensor language_model.model.layers.1.self_attn.q_proj.weight");
  EXPECT_NE(r.err.find("unexpected tensor language_model.model.layers.1.self_attn.x_proj.weight"), std::string::npos);
  EXPECT_NE(r.err.find("2 problems"), std::string::npos) << r.err;
}

TEST(CliBadInput, MisShapedTensor) {
  NEED_SHARED();
  ScratchModel s("shape");
  // Same byte count, transposed shape: the safetensors file is valid, the model binding is not.
  s.edit_header("layers.0.mlp.down_proj.weight\":{\"dtype\":\"F32\",\"shape\":[128,96]",
                "layers.0.mlp.down_proj.weight\":{\"dtype\":\"F32\",\"shape\":[96,128]");
  expect_bad(run_k3("generate " + s.m() + " --ids 1 -n 1 --greedy"),
             "tensor language_model.model.layers.0.mlp.down_proj.weight has shape [96, 128], expected [128, 96]");
}

TEST(CliBadInput, UnsupportedDtype) {
  NEED_SHARED();
  ScratchModel s("dtype");
  // I32 has the same width as F32: a valid file with a dtype no matrix may have.
  s.edit_header("layers.0.mlp.down_proj.weight\":{\"dtype\":\"F32\"",
                "layers.0.mlp.down_proj.weight\":{\"dtype\":\"I32\"");
  expect_bad(run_k3("generate " + s.m() + " --ids 1 -n 1 --greedy"), "has unsupported dtype I32");
}

TEST(CliBadInput, ConfigProblems) {
  NEED_SHARED();
  {
    ScratchModel s("cfg_missing");
    s.edit_config([](nlohmann::json& j) {
      j["text_config"].erase("hidden_size");
      j["text_config"]["linear_attn_config"].erase("num_heads");
    });
    const auto r = run_k3("generate " + s.m() + " --ids 1 -n 1 --greedy");
    expect_bad(r, "hidden_size");
    EXPECT_NE(r.err.find("num_heads"), std::string::npos) << r.err;
  }
  {
    ScratchModel s("cfg_act");
    s.edit_config([](nlohmann::json& j) { j["text_config"]["hidden_act"] = "gelu"; });
    expect_bad(run_k3("generate " + s.m() + " --ids 1 -n 1 --greedy"),
               "config.json: hidden_act \"gelu\" is not implemented by this engine");
  }
  {
    // A family member with RoPE in MLA: `k3 info` describes it, running it is refused in one line.
    ScratchModel s("cfg_rope");
    s.edit_config([](nlohmann::json& j) { j["text_config"]["mla_use_nope"] = false; });
    const auto info = run_k3("info " + s.m());
    ASSERT_EQ(info.code, 0) << info.err;
    EXPECT_NE(info.out.find("engine support: this engine cannot run this family member"), std::string::npos)
        << info.out;
    expect_bad(run_k3("generate " + s.m() + " --ids 1 -n 1 --greedy"),
               "config.json: mla_use_nope false (RoPE in MLA) is not implemented by this engine");
  }
  {
    // The plain residual sum is implemented (Kimi Linear), so a K3 checkpoint whose config lost
    // attn_res_block_size is refused at the tensors it still has, in one line.
    ScratchModel s("cfg_plain_residual");
    s.edit_config([](nlohmann::json& j) { j["text_config"].erase("attn_res_block_size"); });
    const auto info = run_k3("info " + s.m());
    ASSERT_EQ(info.code, 0) << info.err;
    EXPECT_NE(info.out.find("plain residual sum"), std::string::npos) << info.out;
    expect_bad(run_k3("generate " + s.m() + " --ids 1 -n 1 --greedy"),
               "checkpoint does not match config: 54 problems: unexpected tensor "
               "language_model.model.layers.0.mlp_res_norm.weight");
  }
  {
    ScratchModel s("cfg_layers");
    s.edit_config([](nlohmann::json& j) {
      j["text_config"]["linear_attn_config"]["full_attn_layers"] = {4, 8, 12, 14};
    });
    expect_bad(run_k3("generate " + s.m() + " --ids 1 -n 1 --greedy"), "14");
  }
  {
    ScratchModel s("cfg_extra");  // keys the engine does not use are ignored
    s.edit_config([](nlohmann::json& j) {
      j["vision_config"] = {{"patch_size", 14}};
      j["text_config"]["head_dim"] = 74;
    });
    EXPECT_EQ(run_k3("generate " + s.m() + " --ids 1,2 -n 2 --greedy --print-ids").code, 0);
  }
}

TEST(CliBadInput, TruncatedWeights) {
  NEED_SHARED();
  ScratchModel s("trunc");
  fs::resize_file(s.dir / "model.safetensors", fs::file_size(s.dir / "model.safetensors") - 1000);
  expect_bad(run_k3("generate " + s.m() + " --ids 1 -n 1 --greedy"), "model.safetensors");
}

TEST(Cli, HelpForEverySubcommand) {
  for (const char* sub : {"logits", "generate", "info"}) {
    const auto r = run_k3(std::string(sub) + " --help");
    EXPECT_EQ(r.code, 0) << sub;
    EXPECT_NE(r.out.find("--model"), std::string::npos) << sub << ": " << r.out;
  }
}

// The batch contract: every line of --ids-file is one prompt; all of them run together, and each
// line's result equals that prompt run alone with --ids (generate: the ids; logits: the bytes).
TEST(CliBatch, IdsFileEqualsEachPromptAlone) {
  const std::string m = "--model " + quote((fs::path(K3_SOURCE_DIR) / "models/k3-nano").string());
  const std::vector<std::string> prompts{"11,220,3300,4,57", "900", "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19",
                                         "4000,4001"};
  const std::string tag = std::to_string(::getpid());
  const fs::path file = fs::temp_directory_path() / ("k3cli_batch_" + tag);
  {
    std::ofstream f(file);
    for (const auto& p : prompts) f << p << "\n";
  }
  const auto batched = run_k3("generate " + m + " --ids-file " + file.string() + " -n 6 --greedy --print-ids");
  ASSERT_EQ(batched.code, 0) << batched.err;
  std::string alone;
  for (const auto& p : prompts) {
    const auto r = run_k3("generate " + m + " --ids " + p + " -n 6 --greedy --print-ids");
    ASSERT_EQ(r.code, 0) << r.err;
    alone += r.out;
  }
  EXPECT_EQ(batched.out, alone);
  EXPECT_EQ(std::count(batched.out.begin(), batched.out.end(), '\n'), 4);

  const fs::path prefix = fs::temp_directory_path() / ("k3cli_batch_logits_" + tag);
  const auto lb = run_k3("logits " + m + " --ids-file " + file.string() + " --out " + prefix.string());
  ASSERT_EQ(lb.code, 0) << lb.err;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const fs::path one = prefix.string() + ".alone";
    const auto la = run_k3("logits " + m + " --ids " + prompts[i] + " --out " + one.string());
    ASSERT_EQ(la.code, 0) << la.err;
    const fs::path got = prefix.string() + "." + std::to_string(i);
    EXPECT_EQ(k3test::slurp(got), k3test::slurp(one)) << "prompt " << i;
    const size_t T = size_t(std::count(prompts[i].begin(), prompts[i].end(), ',') + 1);
    EXPECT_EQ(fs::file_size(got), T * 8448 * 4);  // [T, vocab] float32, K3-nano's vocab_size 8448
    fs::remove(got);
    fs::remove(one);
  }
  // Bad files: one line naming the file and line.
  std::ofstream(file) << "1,2\n\n3\n";
  expect_bad(run_k3("generate " + m + " --ids-file " + file.string() + " -n 2 --greedy"), ":2: empty line");
  std::ofstream(file) << "1,2\n3,x\n";
  expect_bad(run_k3("generate " + m + " --ids-file " + file.string() + " -n 2 --greedy"), ":2: ");
  expect_bad(run_k3("generate " + m + " --ids 1 --ids-file " + file.string() + " -n 2 --greedy"), "excludes");
  expect_bad(run_k3("generate " + m + " -n 2 --greedy"), "--ids or --ids-file");
  expect_bad(run_k3("logits " + m + " --ids-file /nonexistent/ids --out /tmp/x"), "/nonexistent/ids");
  fs::remove(file);
}
