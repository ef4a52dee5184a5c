// Tests for architecture statistics (src/config/arch_stats.*): the spec §2.11 / §5 acceptance
// numbers on the released K3 config, an independent tensor-header census of the third-party tiny
// checkpoint, the layer map / snapshot layers, number formatting and the `k3 info` report.
// Must not: derive expected values from the code under test (they come from the spec or the fixture).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "config/arch_stats.h"
#include "config/model_config.h"
#include "core/error.h"

namespace {

const std::string kRealConfig = std::string(K3_SOURCE_DIR) + "/tests/fixtures/k3-config-only/config.json";
const std::string kTinyDir = std::string(K3_SHARED_DIR) + "/fixtures/third-party/kimi-k3-in-c-tiny";

k3::ModelConfig real() { return k3::load_model_config(kRealConfig); }

}  // namespace

TEST(ArchStats, SpecBlockParameterCounts) {
  const k3::ArchParams a = k3::compute_arch_params(real());
  // spec §2.11
  EXPECT_EQ(a.kda_attention, 443740416);
  EXPECT_EQ(a.mla_attention, 232196096);
  EXPECT_EQ(a.moe_excl_routed, 189927808);
  EXPECT_EQ(a.dense_ffn, 726663168);
  EXPECT_EQ(a.routed_expert, 33030144);
  EXPECT_EQ(a.always_active, 56743648000LL);
  EXPECT_EQ(a.total, 2779484478208LL);
  // Per layer: 4 norms [7168] + 2 AttnRes projections [1, 7168] (§2.4); model level §2.3.
  EXPECT_EQ(a.layer_norms, 6 * 7168);
  EXPECT_EQ(a.embedding, 163840LL * 7168);
  EXPECT_EQ(a.lm_head, 163840LL * 7168);
  EXPECT_EQ(a.final_norm, 7168);
  EXPECT_EQ(a.output_attn_res, 2 * 7168);
  EXPECT_EQ(a.n_kda_layers, 69);
  EXPECT_EQ(a.n_mla_layers, 24);
  EXPECT_EQ(a.n_dense_layers, 1);
  EXPECT_EQ(a.n_moe_layers, 92);
  // 82,432 routed experts in total (§2.1 tensor-count check).
  EXPECT_EQ(a.routed_experts_total, 82432LL * 33030144);
}

TEST(ArchStats, ActiveParametersPerToken) {
  const k3::ArchParams a = k3::compute_arch_params(real());
  // §2.11: trunk + lm_head + 16 x 92 experts, embedding table excluded: ~104.19 B.
  EXPECT_NEAR(double(a.active_per_token), 104.19e9, 0.005e9);
  // Exact: always-active (spec) - embedding + 16*92 experts.
  EXPECT_EQ(a.active_per_token, 56743648000LL - 163840LL * 7168 + 16LL * 92 * 33030144);
  EXPECT_EQ(a.active_per_token, 104189614848LL);
}

TEST(ArchStats, DecodeStateAndCacheBytes) {
  const k3::ModelConfig c = real();
  // §5
  EXPECT_EQ(k3::kda_recurrent_state_bytes(c), 434110464);
  EXPECT_EQ(k3::kda_conv_state_bytes(c), 69LL * 442368);
  EXPECT_EQ(k3::kda_recurrent_state_bytes(c) + k3::kda_conv_state_bytes(c), 464633856);
  EXPECT_EQ(k3::mla_cache_bytes_per_token(c), 27648);
  EXPECT_EQ(k3::mla_cache_bytes_per_token(c, 4), 55296);
  EXPECT_EQ(k3::mla_cache_bytes(c, 1048576), 28991029248LL);
  EXPECT_EQ(k3::mla_cache_bytes(c, 0), 0);
}

TEST(ArchStats, LayerMapAndSnapshots) {
  const k3::ModelConfig c = real();
  const std::string map = k3::layer_map_string(c);
  // 93 layers + a space after each of the 7 complete AttnRes blocks of 12.
  EXPECT_EQ(map.size(), 93u + 7u);
  EXPECT_EQ(map.substr(0, 13), "KKKMKKKMKKKM ");
  // Last block = layers 84..92: KDA 84-86, MLA 87, KDA 88-90, MLA 91, 92.
  EXPECT_EQ(map.substr(map.size() - 10), " KKKMKKKMM");
  EXPECT_EQ(std::count(map.begin(), map.end(), 'M'), 24);
  EXPECT_EQ(std::count(map.begin(), map.end(), 'K'), 69);
  EXPECT_EQ(k3::attn_res_snapshot_layers(c), (std::vector<int64_t>{0, 12, 24, 36, 48, 60, 72, 84}));
  const auto mla = k3::mla_layers_zero_based(c);
  ASSERT_EQ(mla.size(), 24u);
  EXPECT_EQ(mla.front(), 3);
  EXPECT_EQ(mla[mla.size() - 2], 91);
  EXPECT_EQ(mla.back(), 92);
  EXPECT_EQ(k3::kda_layers_zero_based(c).size(), 69u);
}

// Independent check: sum the element counts of every text-model tensor in the tiny checkpoint's
// safetensors header and compare with the shape arithmetic.
TEST(ArchStats, TinyCheckpointCensusMatches) {
  const std::string st = kTinyDir + "/model.safetensors";
  if (!std::filesystem::exists(st)) GTEST_SKIP() << "third-party fixture absent: " << kTinyDir;
  std::ifstream in(st, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  ASSERT_TRUE(in.good());
  ASSERT_LT(n, 100000000u);
  std::string header(n, '\0');
  in.read(header.data(), static_cast<std::streamsize>(n));
  ASSERT_TRUE(in.good());
  const nlohmann::json h = nlohmann::json::parse(header);
  int64_t total = 0, experts = 0, embed = 0;
  for (const auto& [name, t] : h.items()) {
    if (name == "__metadata__" || name.rfind("language_model.", 0) != 0) continue;
    int64_t numel = 1;
    for (const auto& d : t["shape"]) numel *= d.get<int64_t>();
    total += numel;
    if (name.find(".experts.") != std::string::npos) experts += numel;
    if (name.find("embed_tokens") != std::string::npos) embed += numel;
  }
  const k3::ModelConfig c = k3::load_model_config(kTinyDir);
  const k3::ArchParams a = k3::compute_arch_params(c);
  EXPECT_EQ(a.total, total);
  EXPECT_EQ(a.routed_experts_total, experts);
  EXPECT_EQ(a.always_active, total - experts);
  EXPECT_EQ(a.embedding, embed);
  EXPECT_EQ(k3::attn_res_snapshot_layers(c), (std::vector<int64_t>{0, 3, 6, 9, 12}));
  EXPECT_EQ(k3::layer_map_string(c), "KKK MKK KMK KKM M");
  EXPECT_EQ(k3::mla_layers_zero_based(c), (std::vector<int64_t>{3, 7, 11, 12}));
  // 4 MLA layers x (kv_lora 32 + rope 8) x 2 bytes.
  EXPECT_EQ(k3::mla_cache_bytes_per_token(c), 4 * 40 * 2);
  // 9 KDA layers x 4 heads x 16 x 16 x 4 bytes.
  EXPECT_EQ(k3::kda_recurrent_state_bytes(c), 9 * 4 * 16 * 16 * 4);
}

TEST(ArchStats, FormatThousands) {
  EXPECT_EQ(k3::format_thousands(0), "0");
  EXPECT_EQ(k3::format_thousands(999), "999");
  EXPECT_EQ(k3::format_thousands(1000), "1,000");
  EXPECT_EQ(k3::format_thousands(2779484478208LL), "2,779,484,478,208");
  EXPECT_EQ(k3::format_thousands(-1234567), "-1,234,567");
  EXPECT_EQ(k3::format_thousands(std::numeric_limits<int64_t>::min()), "-9,223,372,036,854,775,808");
}

TEST(ArchStats, ReportContainsTheNumbers) {
  const k3::ModelConfig c = real();
  const std::string r = k3::format_arch_report(c, 4096);
  for (const char* part : {"2,779,484,478,208", "104,189,614,848", "56,743,648,000", "443,740,416", "232,196,096",
                           "189,927,808", "726,663,168", "33,030,144", "434,110,464", "27,648 B bf16", "55,296 B fp32",
                           "28,991,029,248", "at 1,048,576 tokens", "at 4,096 tokens",
                           "113,246,208",  // 27,648 x 4,096
                           "top-16", "896 routed experts", "69 KDA, 24 MLA", "KKKMKKKMKKKM KKKM"}) {
    EXPECT_NE(r.find(part), std::string::npos) << "report lacks " << part << "\n" << r;
  }
  EXPECT_EQ(r.back(), '\n');
}

TEST(ArchStats, OverflowIsANamedError) {
  k3::ModelConfig c = real();
  c.num_experts = int64_t{1} << 24;
  c.moe_intermediate_size = int64_t{1} << 24;
  c.routed_expert_hidden_size = int64_t{1} << 24;
  try {
    k3::compute_arch_params(c);
    FAIL() << "overflow not detected";
  } catch (const k3::Error& e) {
    EXPECT_EQ(std::string(e.what()), "architecture statistics: size overflows int64");
  }
}
