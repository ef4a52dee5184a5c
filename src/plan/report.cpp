// Text and JSON forms of a plan (see report.h).
// Must not: round a number in the JSON (it carries the planner's doubles as they are).
#include "plan/report.h"

#include <cstdio>
#include <nlohmann/json.hpp>

#include "plan/units.h"
#include "runtime/memory.h"

namespace k3::plan {

namespace {

using Json = nlohmann::ordered_json;

std::string pad(std::string s, size_t n) {
  if (s.size() < n) s.resize(n, ' ');
  return s;
}

std::string f3(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3g", v);
  return b;
}

std::string kind_name(const Plan& p) {
  std::string k = p.kind == "gpu"      ? "all on GPUs"
                  : p.kind == "hybrid" ? "hybrid: GPU trunk + routed experts in host RAM (CPU) / disk"
                                       : "CPU only";
  if (p.world > 1)
    k += " (TP" + std::to_string(p.tp) + " EP" + std::to_string(p.ep) + ", " + std::to_string(p.world) + " GPUs)";
  return k;
}

std::string rate_row(const char* name, const Sourced<double>& r, bool flops) {
  return "  " + pad(name, 26) + pad(flops ? human_flops(r.value) : human_rate(r.value), 14) + r.source + "\n";
}

Json terms_json(const DecodeTerms& d) {
  Json j = {{"batch", d.batch},
            {"distinct_experts_per_layer", d.distinct},
            {"experts_on_busiest_gpu_per_layer", d.max_shard},
            {"gpu_trunk_s", d.gpu_trunk},
            {"gpu_shared_s", d.gpu_shared},
            {"gpu_state_s", d.gpu_state},
            {"gpu_experts_s", d.gpu_experts},
            {"collectives_s", d.comm},
            {"gpu_layers_s", d.gpu_layers},
            {"cpu_experts_s", d.cpu_experts},
            {"disk_s", d.disk},
            {"pcie_s", d.pcie},
            {"sync_s", d.sync},
            {"gpu_total_s", d.gpu_total},
            {"cpu_total_s", d.cpu_total},
            {"serial_s", d.serial},
            {"overlapped_s", d.overlapped},
            {"ideal_overlap_s", d.ideal},
            {"step_s", d.step},
            {"tokens_per_s", d.tokens_per_s},
            {"how", d.how}};
  j["arithmetic"] = d.arithmetic;
  return j;
}

Json prefill_json(const PrefillTerms& f) {
  Json j = {
      {"prompt", f.prompt},
      {"chunk", f.chunk},
      {"chunks", f.chunks},
      {"flops_trunk_per_token", f.flops_trunk},
      {"flops_experts_per_token", f.flops_experts},
      {"a_cpu_experts", {{"gpu_s", f.a_gpu}, {"cpu_s", f.a_cpu}, {"pcie_sync_s", f.a_pcie}, {"total_s", f.a_total}}},
      {"b_stream_experts",
       {{"possible", f.b_possible},
        {"compute_s", f.b_compute},
        {"stream_s", f.b_stream},
        {"disk_s", f.b_disk},
        {"total_s", f.b_total}}},
      {"gpu_s", f.gpu},
      {"collectives_s", f.comm},
      {"cpu_s", f.cpu},
      {"disk_s", f.disk},
      {"seconds", f.seconds},
      {"tokens_per_s", f.tokens_per_s},
      {"choice", f.choice}};
  j["arithmetic"] = f.arithmetic;
  return j;
}

Json plan_json(const Plan& p) {
  Json items = Json::array();
  for (const PlacementItem& i : p.items)
    items.push_back({{"what", i.what}, {"where", i.where}, {"bytes", i.bytes}, {"note", i.note}});
  Json j = {{"kind", p.kind},
            {"tp", p.tp},
            {"ep", p.ep},
            {"dp", p.dp},
            {"gpus", p.world},
            {"fits", p.fits},
            {"why_not", p.why_not},
            {"items", items},
            {"per_gpu",
             {{"budget", p.gpu_budget},
              {"weights", p.gpu_weights},
              {"state", p.gpu_state},
              {"workspace", p.gpu_workspace},
              {"reserve", p.gpu_reserve},
              {"expert_cache", p.gpu_cache}}},
            {"host", {{"weight_budget", p.host_budget}, {"used", p.host_used}}},
            {"routed_experts", {{"on_gpus", p.frac_gpu}, {"in_ram", p.frac_ram}, {"on_disk", p.frac_disk}}},
            {"expert_hit", p.hit},
            {"expert_hit_source", p.hit_source}};
  j["decode_batch1"] = terms_json(p.decode1);
  j["decode_batch"] = terms_json(p.decodeB);
  j["prefill"] = prefill_json(p.prefill);
  j["notes"] = p.notes;
  return j;
}

Json sourced(double v, const std::string& s) { return {{"value", v}, {"source", s}}; }

}  // namespace

std::string format_json(const ReportInput& in) {
  const ModelSizes& s = in.sizes;
  const Machine& m = in.machine;
  const Rates& r = in.rates;
  Json j;
  j["k3_plan"] = 1;
  j["model"] = {{"config", s.name},
                {"bytes_source", s.bytes_source},
                {"layers", s.layers},
                {"kda_layers", s.kda_layers},
                {"mla_layers", s.mla_layers},
                {"moe_layers", s.moe_layers},
                {"experts", s.experts},
                {"top_k", s.top_k},
                {"hidden", s.hidden},
                {"expert_latent", s.latent},
                {"trunk_params", s.trunk_params},
                {"trunk_bytes", s.trunk_bytes},
                {"shared_expert_bytes_per_layer", s.shared_bytes},
                {"embedding_bytes", s.embed_bytes},
                {"lm_head_bytes", s.lm_head_bytes},
                {"expert_bytes", s.expert_bytes},
                {"routed_expert_bytes", s.experts_total_bytes()},
                {"kda_state_bytes_per_seq", s.kda_state_bytes},
                {"mla_bytes_per_token", s.mla_bytes_per_token}};
  Json mj = {{"description", m.description},
             {"nodes", m.nodes},
             {"gpus_per_node", m.gpus_per_node},
             {"gpu", m.gpu ? Json(m.gpu->name) : Json(nullptr)},
             {"gpu_source", m.gpu ? Json(m.gpu->source) : Json(in.gpu_note)},
             {"ram", sourced(double(m.ram.value), m.ram.source)},
             {"ram_budget", m.ram_budget ? Json(double(*m.ram_budget)) : Json(nullptr)},
             {"cores", {{"value", m.cores.value}, {"source", m.cores.source}}},
             {"cpu_isa", {{"value", m.cpu_amx.value ? "amx" : "avx512"}, {"source", m.cpu_amx.source}}},
             {"cpu_bw", sourced(m.cpu_bw.value, m.cpu_bw.source)},
             {"disk", sourced(m.disk.value, m.disk.source)}};
  if (m.gpu) {
    mj["gpu_mem"] = sourced(double(m.gpu_mem.value), m.gpu_mem.source);
    mj["pcie"] = sourced(m.pcie.value, m.pcie.source);
    mj["nvlink"] = sourced(m.nvlink.value, m.nvlink.source);
    mj["net"] = sourced(m.net.value, m.net.source);
  }
  j["machine"] = mj;
  Json rj = {{"mode", r.mode}};
  const auto add = [&](const char* k, const Sourced<double>& v) {
    if (v.value > 0) rj[k] = sourced(v.value, v.source);
  };
  add("gpu_trunk_gemv_Bps", r.gpu_trunk_Bps);
  add("gpu_expert_gemv_Bps", r.gpu_expert_Bps);
  add("gpu_decode_flops", r.gpu_decode_flops);
  add("gpu_gemm_flops", r.gpu_gemm_flops);
  add("gpu_expert_gemm_flops", r.gpu_expert_gemm_flops);
  add("pcie_Bps", r.pcie_Bps);
  add("nvlink_Bps", r.nvlink_Bps);
  add("net_Bps", r.net_Bps);
  add("cpu_expert_gemv_Bps", r.cpu_expert_Bps);
  add("cpu_expert_gemv_f32_Bps", r.cpu_expert_f32_Bps);
  add("cpu_expert_gemm_flops", r.cpu_expert_flops);
  add("cpu_bf16_gemv_Bps", r.cpu_bf16_Bps);
  add("cpu_bf16_gemm_flops", r.cpu_bf16_flops);
  add("cpu_expert_prefill_gemm_flops", r.cpu_expert_prefill_flops);
  add("cpu_bf16_prefill_gemm_flops", r.cpu_bf16_prefill_flops);
  add("cpu_mem_read_Bps", r.cpu_mem_Bps);
  add("disk_Bps", r.disk_Bps);
  add("sync_s", r.lat.sync);
  if (m.gpu) rj["gpu_layer_s"] = sourced(r.lat.gpu_layer.value, r.lat.gpu_layer.source);  // (0 is a value here)
  add("collective_intra_s", r.lat.coll_intra);
  add("collective_inter_s", r.lat.coll_inter);
  rj["notes"] = r.notes;
  j["rates"] = rj;
  const PlanRequest& q = in.request;
  j["request"] = {{"ctx", q.ctx},
                  {"batch", q.batch},
                  {"prompt", q.prompt},
                  {"expert_hit", q.expert_hit ? Json(*q.expert_hit) : Json(nullptr)},
                  {"hot_experts", q.hot_experts ? Json(*q.hot_experts) : Json(nullptr)},
                  {"tp", q.tp},
                  {"ep", q.ep},
                  {"trunk_fp8", q.trunk_fp8},
                  {"cpu_experts_q8", q.cpu_experts_q8},
                  {"placement", q.placement}};
  j["plan"] = plan_json(in.result.best);
  // Every placement evaluated, in short (the chosen one is "plan" above, with all its terms).
  Json alt = Json::array();
  for (const Plan& p : in.result.considered)
    alt.push_back({{"kind", p.kind},
                   {"tp", p.tp},
                   {"ep", p.ep},
                   {"gpus", p.world},
                   {"fits", p.fits},
                   {"why_not", p.why_not},
                   {"expert_hit", p.hit},
                   {"decode_batch1", {{"step_s", p.decode1.step}, {"tokens_per_s", p.decode1.tokens_per_s}}},
                   {"decode_batch",
                    {{"batch", p.decodeB.batch}, {"step_s", p.decodeB.step}, {"tokens_per_s", p.decodeB.tokens_per_s}}},
                   {"prefill",
                    {{"prompt", p.prefill.prompt},
                     {"seconds", p.prefill.seconds},
                     {"tokens_per_s", p.prefill.tokens_per_s},
                     {"choice", p.prefill.choice}}}});
  j["considered"] = alt;
  j["notes"] = in.result.notes;
  return j.dump(2) + "\n";
}

std::string format_text(const ReportInput& in) {
  const ModelSizes& s = in.sizes;
  const Machine& m = in.machine;
  const Rates& r = in.rates;
  const PlanRequest& q = in.request;
  const Plan& p = in.result.best;
  std::string o;
  o += "k3 plan: " + s.name + ", context " + std::to_string(q.ctx) + ", batch " + std::to_string(q.batch) +
       ", prompt " + std::to_string(q.prompt) + "\n";
  o += "model     " + std::to_string(s.layers) + " layers (" + std::to_string(s.kda_layers) + " KDA, " +
       std::to_string(s.mla_layers) + " MLA), " + std::to_string(s.moe_layers) + " MoE layers x " +
       std::to_string(s.experts) + " experts, top-" + std::to_string(s.top_k) + "\n";
  o += "          trunk " + human_dec_bytes(s.trunk_bytes) + " + embedding " + human_dec_bytes(s.embed_bytes) +
       " + lm_head " + human_dec_bytes(s.lm_head_bytes) + "; routed experts " +
       human_dec_bytes(s.experts_total_bytes()) + " (" + human_dec_bytes(s.expert_bytes) + " each)\n";
  o += "          per sequence (fp32, as k3 holds it): KDA state " + human_dec_bytes(s.kda_state_bytes) +
       ", MLA cache " + human_dec_bytes(s.mla_bytes_per_token) + "/token\n";
  o += "          bytes: " + s.bytes_source + "\n";
  if (q.trunk_fp8)
    o += "          FP8 trunk (--trunk-fp8): trunk matrices at 1 B/weight + 128x128 block scales; router, "
         "embedding, lm_head bf16 (on a GPU: a scale per row and 128 columns, the MLA kv_b_proj in fp32)\n";
  o += "machine   " + m.description + "\n";
  if (m.gpu)
    o += "          " + std::to_string(m.nodes) + " node(s) x " + std::to_string(m.gpus_per_node) + " x " +
         m.gpu->name + ", " + human_bytes(m.gpu_mem.value) + " per GPU (" + m.gpu_mem.source + ")\n";
  else
    o += "          no GPU" + (in.gpu_note.empty() ? "" : " (" + in.gpu_note + ")") + "\n";
  o += "          host " + human_bytes(m.ram.value) + " RAM (" + m.ram.source + "), " + std::to_string(m.cores.value) +
       " cores (" + m.cores.source + ")" + (m.cpu_name.empty() ? "" : ", " + m.cpu_name) + ", prefill GEMMs on " +
       (m.cpu_amx.value ? "amx tiles" : "avx512") + " (" + m.cpu_amx.source + ")\n";
  if (m.ram_budget) o += "          --ram-budget " + human_bytes(*m.ram_budget) + " for weights\n";
  o += "rates: " + r.mode + "\n";
  if (m.gpu) {
    o += rate_row("GPU trunk GEMV", r.gpu_trunk_Bps, false);
    o += rate_row("GPU expert GEMV", r.gpu_expert_Bps, false);
    o += rate_row("GPU decode compute", r.gpu_decode_flops, true);
    o += rate_row("GPU prefill (trunk)", r.gpu_gemm_flops, true);
    o += rate_row("GPU prefill (experts)", r.gpu_expert_gemm_flops, true);
    o += rate_row("PCIe", r.pcie_Bps, false);
    if (m.world() > 1) {
      o += rate_row("NVLink", r.nvlink_Bps, false);
      if (m.nodes > 1) o += rate_row("network", r.net_Bps, false);
    }
  }
  o += rate_row("CPU expert GEMV", r.cpu_expert_Bps, false);
  o += rate_row("CPU expert GEMV fp32", r.cpu_expert_f32_Bps, false);
  o += rate_row("CPU expert GEMM", r.cpu_expert_flops, true);
  o += rate_row("CPU BF16 GEMV", r.cpu_bf16_Bps, false);
  o += rate_row("CPU BF16 GEMM", r.cpu_bf16_flops, true);
  if (r.cpu_expert_prefill_flops.value != r.cpu_expert_flops.value) {
    o += rate_row("CPU expert GEMM, prefill", r.cpu_expert_prefill_flops, true);
    o += rate_row("CPU BF16 GEMM, prefill", r.cpu_bf16_prefill_flops, true);
  }
  o += rate_row("CPU memory read", r.cpu_mem_Bps, false);
  o += rate_row("disk", r.disk_Bps, false);
  if (m.gpu) {
    o += "  " + pad("GPU<->CPU sync / layer", 26) + pad(human_seconds(r.lat.sync.value), 14) + r.lat.sync.source + "\n";
    o += "  " + pad("GPU work / layer", 26) + pad(human_seconds(r.lat.gpu_layer.value), 14) + r.lat.gpu_layer.source +
         "\n";
    if (m.world() > 1)
      o += "  " + pad("collective latency", 26) +
           pad(human_seconds(r.lat.coll_intra.value) + " / " + human_seconds(r.lat.coll_inter.value), 14) +
           "intra / inter node: " + r.lat.coll_intra.source + "; " + r.lat.coll_inter.source + "\n";
  }
  for (const std::string& n : r.notes) o += "  note: " + n + "\n";
  o += "placement " + kind_name(p) + ": fits\n";
  for (const PlacementItem& i : p.items)
    if (i.bytes > 0) o += "  " + pad(i.what, 58) + pad(i.where, 10) + pad(human_dec_bytes(i.bytes), 11) + i.note + "\n";
  if (p.kind != "cpu") {
    o += "  per GPU: weights " + human_dec_bytes(p.gpu_weights) + " + state " + human_dec_bytes(p.gpu_state) +
         " + workspace " + human_dec_bytes(p.gpu_workspace) + " + reserve " + human_dec_bytes(p.gpu_reserve) + " of " +
         human_dec_bytes(p.gpu_budget) + "; free for hot experts " + human_dec_bytes(p.gpu_cache) + "\n";
    if (p.kind == "hybrid") o += "  expert hit rate " + f3(p.hit) + ": " + p.hit_source + "\n";
  }
  if (p.host_budget > 0)
    o += "  host: " + human_dec_bytes(p.host_used) + " of a " + human_dec_bytes(p.host_budget) + " weight budget (" +
         (m.ram_budget ? "--ram-budget" : "RAM less 5%, within 4..32 GiB") + ")" +
         (p.frac_disk > 0 ? "; " + f3(100 * p.frac_disk) + "% of the routed experts on disk" : "") + "\n";
  const auto decode_block = [&](const DecodeTerms& d, const std::string& title) {
    o += title + "\n";
    for (const std::string& a : d.arithmetic) o += "  " + a + "\n";
    o += "  step " + human_seconds(d.step) + ": " + d.how + "\n";
    char b[96];
    std::snprintf(b, sizeof b, "  => %.3g tokens/s%s\n", d.tokens_per_s, d.batch > 1 ? " aggregate" : "");
    o += b;
  };
  decode_block(p.decode1, "decode, batch 1");
  if (q.batch > 1) decode_block(p.decodeB, "decode, batch " + std::to_string(q.batch));
  o += "prefill, " + std::to_string(q.prompt) + " tokens\n";
  for (const std::string& a : p.prefill.arithmetic) o += "  " + a + "\n";
  {
    char b[96];
    std::snprintf(b, sizeof b, "  => %.3g tokens/s (%s)\n", p.prefill.tokens_per_s,
                  human_seconds(p.prefill.seconds).c_str());
    o += "  " + p.prefill.choice + "\n" + b;
  }
  o += "other placements\n";
  for (const char* kind : {"gpu", "hybrid", "cpu"}) {
    // Per kind: its fastest fitting (TP, EP), else why its widest one does not fit.
    const Plan* fit = nullptr;
    const Plan* wide = nullptr;
    for (const Plan& c : in.result.considered) {
      if (c.kind != kind) continue;
      if (c.fits && (!fit || c.decodeB.tokens_per_s > fit->decodeB.tokens_per_s)) fit = &c;
      if (!wide || c.tp * c.ep > wide->tp * wide->ep) wide = &c;
    }
    const Plan* c = fit ? fit : wide;
    if (!c || (c->kind == p.kind && c->tp == p.tp && c->ep == p.ep)) continue;
    char b[160];
    if (c->fits && q.batch > 1)
      std::snprintf(b, sizeof b, "fits: decode %.3g t/s (batch 1), %.3g t/s (batch %lld), prefill %.3g t/s",
                    c->decode1.tokens_per_s, c->decodeB.tokens_per_s, (long long)q.batch, c->prefill.tokens_per_s);
    else if (c->fits)
      std::snprintf(b, sizeof b, "fits: decode %.3g t/s, prefill %.3g t/s", c->decode1.tokens_per_s,
                    c->prefill.tokens_per_s);
    const bool same = c->kind == "hybrid" && c->frac_gpu >= 1 && p.kind == "gpu";
    o += "  " + kind_name(*c) + ": " +
         (same      ? std::string("every routed expert fits on the GPUs: the same as the placement above")
          : c->fits ? std::string(b)
                    : "does not fit: " + c->why_not) +
         "\n";
  }
  for (const std::string& n : p.notes) o += "note: " + n + "\n";
  for (const std::string& n : in.result.notes) o += "note: " + n + "\n";
  o += "Predictions from rates, not measurements of this placement (docs/hybrid.md).\n";
  return o;
}

}  // namespace k3::plan
