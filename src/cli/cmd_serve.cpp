// `k3 serve`: flags, model loading while the HTTP server already answers /health (503 with progress),
// then serving until SIGINT/SIGTERM. Owns the command line and start-up/shut-down order only; the
// server itself is src/server (k3server).
#include "cli/cmd_serve.h"

#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "cli/cli_common.h"
#include "core/comm.h"
#include "core/error.h"
#include "runtime/loader.h"
#include "runtime/memory.h"
#include "server/http_server.h"

namespace fs = std::filesystem;

namespace k3::cli {

namespace {
std::atomic<bool> g_stop{false};
extern "C" void on_stop_signal(int) { g_stop.store(true); }

}  // namespace

int cmd_serve(int argc, char** argv) {
  CLI::App app{
      "k3 serve: an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models, /tokenize,\n"
      "/detokenize, /health, /metrics, and a chat page at /) with continuous batching and a prefix cache.\n"
      "Binds to 127.0.0.1 unless --host says otherwise. docs/server.md has the details."};
  app.name("k3 serve");
  RunEngineFlags ef;
  server::HttpOptions ho;
  server::SchedulerOptions so;
  std::string cache_mem = "1G", alias, max_body = "16M", chat_format;
  double timeout = 600;
  bool no_turn_snapshots = false;
  ho.port = 8080;
  app.add_option("--host", ho.host, "address to listen on (default 127.0.0.1: this machine only)");
  app.add_option("--port", ho.port, "TCP port; 0 = any free port (printed) (default 8080)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--parallel", so.parallel, "requests decoded at once (default 8)")->check(CLI::Range(1, 4096));
  app.add_option("--max-queue", so.max_queue, "requests that may wait for a slot; more get 429 (default 64)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--batch-tokens", so.batch_tokens,
                 "tokens per engine step: decode tokens + prefill pieces (default 512)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  app.add_option("--prefill-chunk", so.prefill_chunk,
                 "prompt pieces end at multiples of this many tokens (default 256)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  app.add_option("--snapshot-every", so.snapshot_every,
                 "prefix cache: snapshot the state every N prompt tokens (a multiple of --prefill-chunk; default 1024)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 30));
  app.add_option("--prefix-cache-mem", cache_mem,
                 "memory for prefix-cache snapshots, e.g. 512M, 4G; 0 = off (default 1G)")
      ->option_text("SIZE");
  app.add_flag("--no-turn-snapshots", no_turn_snapshots,
               "prefix cache: do not keep the state at the end of each reply (only snapshots at prompt-piece "
               "boundaries, which restore bit-identically; see docs/server.md)");
  app.add_option("--api-key", ho.api_key, "require Authorization: Bearer KEY (except / and /health)");
  app.add_option("--cors", ho.cors_origin, "allow browser requests from ORIGIN (e.g. http://localhost:3000, or *)")
      ->option_text("ORIGIN");
  app.add_option("--chat-format", chat_format,
                 "chat format of /v1/chat/completions: xtml (K3) or k2 (Kimi K2 / Kimi Linear); default: the "
                 "checkpoint's (its chat template, else its model_type)")
      ->check(CLI::IsMember({"xtml", "k2"}));
  app.add_option("--alias", alias, "the model id in /v1/models and responses (default: the model directory's name)");
  app.add_option("--timeout", timeout, "seconds a request may take, queueing included (default 600)")
      ->check(CLI::Range(0.001, 1e7));
  app.add_option("--max-body", max_body, "largest request body accepted (default 16M)")->option_text("SIZE");
  ef.add(&app);
  if (const auto code = parse_flags(app, argc, argv)) return *code;

  return run_guarded("k3 serve", [&]() -> int {
    for (const char* f : {"--kda", "--mla", "--chunk"})
      if (app.count(f)) fail(std::string(f) + " is not supported by k3 serve (the Engine API runs the defaults)");
    if (!ef.cpu_isa.empty()) fail("--cpu-isa is not supported by k3 serve");
    so.turn_snapshots = !no_turn_snapshots;
    so.cache_bytes = cache_mem == "0" ? 0 : parse_size(cache_mem, "--prefix-cache-mem");
    ho.max_body_bytes = size_t(parse_size(max_body, "--max-body"));
    server::check_scheduler_options(so);
    if (ho.threads == 0) ho.threads = so.parallel + so.max_queue + 8;
    const std::string dir = resolve_model_dir(ef.model);
    if (ef.cpu_experts && ef.device != "cuda")  // before listening: a flag error is not a load failure
      fail("--cpu-experts goes with --device cuda (on the CPU every routed expert is the CPU's already)");
    parse_hot_experts(ef.hot_experts, ef.cpu_experts);
    check_cpu_experts_q8(ef.cpu_experts_q8, ef.cpu_experts);
    check_gpu_mem(ef.gpu_mem, ef.device == "cuda");

    EngineOptions eo;
    eo.model_dir = dir;
    eo.tokenizer_dir = ef.tokenizer;
    eo.chat_format = chat_format;
    eo.device = ef.device;
    eo.numerics = ef.numerics;
    eo.ram_budget = ef.ram_budget;
    eo.direct_io = ef.direct_io;
    eo.threads = ef.threads;
    eo.mem_limit = ef.mem_limit;
    eo.context = ef.ctx;
    eo.step_tokens = std::max<int64_t>(ef.ubatch, so.batch_tokens);
    eo.prefault = !ef.no_prefault;
    eo.cuda_graphs = !ef.no_graphs;
    eo.cpu_experts = ef.cpu_experts;
    eo.hot_experts = ef.hot_experts;
    eo.cpu_experts_q8 = ef.cpu_experts_q8;
    eo.gpu_mem = ef.gpu_mem;
    eo.tp = ef.tp;
    eo.ep = ef.ep;
    eo.trunk_fp8 = ef.trunk_fp8;
    if (const Communicator* procs = process_group(); procs && procs->rank() != 0) {
      // A rank > 0 of an MPI launch serves no HTTP: it loads its part of the model and follows rank 0's
      // steps (Model::split throws FollowerDone when rank 0 closes the group).
      Engine::load(eo);
      fail("internal error: a follower rank's engine returned from loading");
    }

    ::signal(SIGPIPE, SIG_IGN);
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);

    server::Metrics metrics;
    server::HttpServer http(ho, metrics);
    const int port = http.bind();
    std::thread http_thread([&] { http.serve(); });
    const std::string host = ho.host.find(':') != std::string::npos ? "[" + ho.host + "]" : ho.host;
    const std::string url = "http://" + host + ":" + std::to_string(port);
    std::printf("k3 serve: listening on %s (loading %s; /health answers 503 until it is ready)\n", url.c_str(),
                dir.c_str());
    std::fflush(stdout);

    eo.load_progress = [&](uint64_t d, uint64_t t) { http.set_load_progress(d, t); };
    std::unique_ptr<Engine> engine;
    try {
      const auto t0 = std::chrono::steady_clock::now();
      engine = Engine::load(eo);
      if (!ef.quiet)
        std::fprintf(
            stderr,
            "k3 serve: loaded in %.2f s (context %lld tokens, %s, %s chat format, %d parallel, prefix cache %s)\n",
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
            (long long)engine->max_context(), ef.device.c_str(), engine->chat_format().c_str(), so.parallel,
            so.cache_bytes ? human_bytes(so.cache_bytes).c_str() : "off");
      const ParallelPlan plan{ef.tp, ef.ep};
      if (plan.split() && !ef.quiet)
        std::fprintf(stderr, "k3 serve: split %s over %d ranks %s\n", plan.str().c_str(), plan.world(),
                     process_group() ? "(one process each)" : "in this process");
    } catch (...) {
      http.stop();
      http_thread.join();
      throw;
    }
    server::ApiConfig cfg;
    cfg.model_id = alias.empty() ? fs::path(dir).lexically_normal().filename().string() : alias;
    if (cfg.model_id.empty()) cfg.model_id = fs::path(dir).lexically_normal().parent_path().filename().string();
    cfg.context = engine->max_context();
    cfg.sampling_defaults = engine->sampling_defaults();
    cfg.add_bos = wants_bos(ef.tokenizer.empty() ? dir : ef.tokenizer);
    cfg.timeout_s = timeout;
    cfg.prefix_cache = so.cache_bytes > 0;
    server::Scheduler sched(*engine, so, metrics);
    http.set_ready(engine.get(), &sched, cfg);
    std::printf("k3 serve: ready: %s (model '%s')\n", url.c_str(), cfg.model_id.c_str());
    std::fflush(stdout);
    while (!g_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::fprintf(stderr, "k3 serve: stopping\n");
    http.stop();
    http_thread.join();
    sched.stop();
    return 0;
  });
}

}  // namespace k3::cli
