// `k3 plan`: from a checkpoint's config (-m DIR or --config FILE) and a machine (this one, or flags),
// the placement on GPUs / host RAM / disk and the predicted decode and prefill t/s with the arithmetic
// (plan/ does the work; --json too); `k3 plan --calibrate` writes a calibration `--calibration` reads.
// Must not: load weights, or print a prediction without saying which rates it rests on.
#include "cli/cmd_plan.h"

#include <CLI/CLI.hpp>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <optional>
#include <string>

#include "cli/cli_common.h"
#include "config/model_config.h"
#include "core/error.h"
#include "plan/calibrate.h"
#include "plan/calibration.h"
#include "plan/machine.h"
#include "plan/planner.h"
#include "plan/rates.h"
#include "plan/report.h"
#include "plan/sizes.h"
#include "plan/units.h"
#include "runtime/memory.h"

namespace k3::cli {

namespace {

struct PlanFlags {
  std::string model, config, calibration, out, disk_dir, calib_mem = "1G", disk_size = "1G";
  std::string sync_us, coll_us, net_coll_us, layer_us;
  plan::MachineFlags machine;
  plan::PlanRequest req;
  double expert_hit = -1;
  double hot_experts = -1;
  bool json = false, calibrate = false, calibrate_gpu = false, no_gpu_calibration = false;
  int threads = 0;
};

// /proc/loadavg's first three fields: a busy machine measures lower rates, so the file says how busy it was.
std::string load_average() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  if (!(f >> a >> b >> c)) return "unknown";
  return a + " " + b + " " + c;
}

int run_calibrate(const PlanFlags& f, const std::string& command) {
  plan::CalibrateOptions o;
  o.threads = f.threads;
  o.pool_bytes = parse_size(f.calib_mem, "--calibrate-mem");
  o.disk_bytes = parse_size(f.disk_size, "--disk-size");
  o.disk_dir = f.disk_dir;
  o.progress = [](const std::string& s) { std::fprintf(stderr, "k3 plan: %s\n", s.c_str()); };
  const std::string gpu_why = plan::gpu_unavailable_reason();
  if (f.calibrate_gpu && !gpu_why.empty()) fail("--calibrate-gpu: " + gpu_why);
  o.gpu = gpu_why.empty() && !f.no_gpu_calibration;
  const std::string path = f.out.empty() ? plan::default_calibration_path() : f.out;
  const plan::DetectedMachine here = plan::detect_machine();
  plan::Calibration c;
  c.label = "this machine (k3 plan --calibrate)";
  c.date = utc_now();
  c.command = command;
  c.machine = here.cpu_name + ", " + std::to_string(here.cores) + " cores, " + human_bytes(here.ram_bytes) + "; " +
              here.gpu_note + "; load average before: " + load_average();
  c.cpu = plan::measure_cpu(o, c.sources);
  c.disk = plan::measure_disk(o, c.sources);
  if (o.gpu)
    c.gpu = plan::measure_gpu(o, c.sources);
  else
    std::fprintf(stderr, "k3 plan: GPU part not measured: %s\n",
                 f.no_gpu_calibration ? "--no-gpu-calibration" : gpu_why.c_str());
  plan::write_calibration(c, path);
  std::printf("k3 plan: wrote the calibration to %s (cpu, disk%s)\n", path.c_str(), c.gpu ? ", gpu" : "");
  if (c.disk && c.disk->method != "O_DIRECT") std::printf("k3 plan: note: disk: %s\n", c.disk->note.c_str());
  return 0;
}

int run_plan(const PlanFlags& f) {
  std::string dir;
  ModelConfig cfg;
  if (!f.config.empty()) {
    cfg = load_model_config(f.config);
  } else {
    dir = resolve_model_dir(f.model);
    cfg = load_model_config(dir);
  }
  const plan::ModelSizes sizes = plan::model_sizes(cfg, dir);
  const plan::DetectedMachine here = plan::detect_machine();
  const plan::Machine m = plan::build_machine(f.machine, here);
  std::optional<plan::Calibration> cal;
  if (!f.calibration.empty()) cal = plan::read_calibration(f.calibration);
  plan::Latencies lat = plan::default_latencies();
  if (!f.sync_us.empty()) lat.sync = {plan::parse_micros(f.sync_us, "--sync-us") * 1e-6, "--sync-us " + f.sync_us};
  if (!f.layer_us.empty())
    lat.gpu_layer = {plan::parse_micros(f.layer_us, "--layer-us") * 1e-6, "--layer-us " + f.layer_us};
  if (!f.coll_us.empty())
    lat.coll_intra = {plan::parse_micros(f.coll_us, "--coll-us") * 1e-6, "--coll-us " + f.coll_us};
  if (!f.net_coll_us.empty())
    lat.coll_inter = {plan::parse_micros(f.net_coll_us, "--net-coll-us") * 1e-6, "--net-coll-us " + f.net_coll_us};
  const plan::Rates rates = plan::derive_rates(m, cal ? &*cal : nullptr, lat);
  plan::PlanRequest q = f.req;
  if (f.expert_hit >= 0) q.expert_hit = f.expert_hit;
  if (f.hot_experts >= 0) q.hot_experts = f.hot_experts;
  const plan::PlanResult res = plan::make_plan(cfg, sizes, m, rates, q);
  const plan::ReportInput in{sizes, m, rates, q, res, f.machine.gpus.empty() ? here.gpu_note : ""};
  const std::string text = f.json ? plan::format_json(in) : plan::format_text(in);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}

}  // namespace

int cmd_plan(int argc, char** argv) {
  CLI::App app{
      "k3 plan: where a checkpoint's parts go on a machine (GPUs, host RAM, disk) and the predicted decode and "
      "prefill tokens/s, from the config alone and the machine's rates (nominal figures x stated efficiencies, or "
      "a calibration); k3 plan --calibrate measures this machine's rates"};
  app.name("k3 plan");
  PlanFlags f;
  CLI::Option* model = add_model_option(&app, f.model);
  app.add_option("--config", f.config, "a config.json (or its directory) instead of -m: sizes from the config only")
      ->option_text("FILE")
      ->excludes(model);
  app.add_option("--ctx", f.req.ctx, "context per sequence the placement must hold (MLA cache) (default 4096)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 40));
  app.add_option("--batch", f.req.batch, "decode sequences for the aggregate figure (default 1)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  app.add_option("--prompt", f.req.prompt, "prefill length in tokens (default 4096)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 30));
  app.add_option("--gpus", f.machine.gpus, "GPUs per node: 1xH200, 2xH100-80G, 8xH200, or none (default: detected)")
      ->option_text("NxKIND");
  app.add_option("--nodes", f.machine.nodes, "nodes (hosts) of --gpus each (default 1)")->check(CLI::Range(1, 64));
  app.add_option("--gpu-mem", f.machine.gpu_mem, "cap the memory used on each GPU (e.g. 80G)")->option_text("SIZE");
  app.add_option("--ram", f.machine.ram, "host RAM per node (default: /proc/meminfo)")->option_text("SIZE");
  app.add_option("--ram-budget", f.machine.ram_budget,
                 "host RAM the weights may use per node (routed experts beyond it go to disk)")
      ->option_text("SIZE");
  app.add_option("--cpu-bw", f.machine.cpu_bw, "host memory bandwidth per node, bytes/s (e.g. 400G)")
      ->option_text("RATE");
  app.add_option("--cores", f.machine.cores, "CPU cores per node (default: this machine's)")->option_text("N");
  app.add_option("--cpu-isa", f.machine.cpu_isa,
                 "the cores' kernel level for the prefill GEMMs: avx512, or amx (Xeons with AMX tiles) "
                 "(default: this machine's level; avx512 for a machine described by flags)")
      ->option_text("LEVEL");
  app.add_option("--pcie", f.machine.pcie, "host <-> GPU rate per GPU and direction (default: the GPU's datasheet)")
      ->option_text("RATE");
  app.add_option("--disk", f.machine.disk, "sequential read rate of the expert disk (default 7G, assumed)")
      ->option_text("RATE");
  app.add_option("--net", f.machine.net, "inter-node rate per GPU (default 50G: InfiniBand NDR 400 Gb/s)")
      ->option_text("RATE");
  app.add_option("--nvlink", f.machine.nvlink, "NVLink rate per GPU and direction (default: the GPU's datasheet)")
      ->option_text("RATE");
  app.add_option("--tp", f.req.tp, "tensor-parallel ways (attention heads and the dense trunk; default: chosen)")
      ->check(CLI::Range(1, 4096));
  app.add_option("--ep", f.req.ep, "expert-parallel ways (routed experts sharded; default: chosen)")
      ->check(CLI::Range(1, 4096));
  app.add_option("--placement", f.req.placement, "force a placement: gpu, hybrid (GPU trunk + host experts), cpu")
      ->check(CLI::IsMember({"auto", "gpu", "hybrid", "cpu"}));
  app.add_option("--expert-hit", f.expert_hit,
                 "fraction of routed-expert reads the GPU's hot-expert cache serves (default: its share of the "
                 "experts, uniform routing)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--hot-experts", f.hot_experts,
                 "with --placement hybrid: the fraction of routed experts the GPU caches, as k3 run --cpu-experts "
                 "--hot-experts F (0: none; default: the spare GPU memory fills)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_flag("--trunk-fp8", f.req.trunk_fp8,
               "plan the trunk in FP8 (E4M3, 128x128 block scales), as k3 run --trunk-fp8 holds it");
  app.add_flag("--cpu-experts-q8", f.req.cpu_experts_q8,
               "hybrid: the CPU's experts with 8-bit activations, as k3 run --cpu-experts-q8 (default: fp32 "
               "activations, the CPU expert GEMV fp32 rate)");
  app.add_option("--sync-us", f.sync_us, "GPU <-> CPU handoff per MoE layer, microseconds (default 20, assumed)");
  app.add_option("--layer-us", f.layer_us,
                 "GPU decode work per layer besides the weight reads, microseconds (default: the calibration's, "
                 "else 72, measured on the H200)");
  app.add_option("--coll-us", f.coll_us, "latency of one collective within a node, microseconds (default 15)");
  app.add_option("--net-coll-us", f.net_coll_us, "latency of one collective across nodes, microseconds (default 30)");
  app.add_option("--calibration", f.calibration, "use the rates of a calibration file (k3 plan --calibrate)")
      ->option_text("FILE");
  app.add_flag("--json", f.json, "print the plan as JSON");
  CLI::Option* calib = app.add_flag("--calibrate", f.calibrate,
                                    "measure this machine's rates (CPU, disk; GPU when built with CUDA and present) "
                                    "and write a calibration file");
  app.add_option("--out", f.out,
                 "with --calibrate: where to write it (default $XDG_CACHE_HOME/k3/calibration.json or "
                 "~/.cache/k3/calibration.json)")
      ->option_text("FILE")
      ->needs(calib);
  app.add_option("-t,--threads", f.threads, "with --calibrate: CPU threads (default: all)")->check(CLI::Range(0, 4096));
  app.add_option("--calibrate-mem", f.calib_mem, "with --calibrate: weight pool the GEMV probes cycle (default 1G)")
      ->needs(calib);
  app.add_option("--disk-dir", f.disk_dir, "with --calibrate: directory of the temporary file (default $TMPDIR, /tmp)")
      ->needs(calib);
  app.add_option("--disk-size", f.disk_size, "with --calibrate: size of the temporary file (default 1G)")->needs(calib);
  app.add_flag("--calibrate-gpu", f.calibrate_gpu, "with --calibrate: require the GPU part (error without a GPU)")
      ->needs(calib);
  app.add_flag("--no-gpu-calibration", f.no_gpu_calibration, "with --calibrate: skip the GPU part")->needs(calib);
  if (const auto code = parse_flags(app, argc, argv)) return *code;
  std::string command = "k3 plan";
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  return run_guarded("k3 plan", [&] { return f.calibrate ? run_calibrate(f, command) : run_plan(f); });
}

}  // namespace k3::cli
