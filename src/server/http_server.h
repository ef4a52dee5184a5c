// The HTTP front of `k3 serve` (cpp-httplib): routes, API-key check, CORS, body limit, JSON errors,
// SSE streaming, client-disconnect detection, /health while loading, /metrics, the bundled page at /.
// Owns connections and the hand-over to the scheduler. Must not: touch the engine's sequences or step
// (only the scheduler does) or serve any file but the bundled page.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "k3/engine.h"
#include "server/api.h"
#include "server/metrics.h"
#include "server/scheduler.h"

namespace httplib {
class Server;
}

namespace k3::server {

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8080;          // 0 = any free port
  std::string api_key;      // "" = no authentication
  std::string cors_origin;  // "" = no CORS headers
  size_t max_body_bytes = 16u << 20;
  int threads = 0;           // HTTP worker threads; 0 = parallel + max_queue + 8
  int write_timeout_s = 10;  // a client that reads nothing for this long is dropped
  int read_timeout_s = 30;
  double keepalive_s = 5;  // SSE comment after this much silence (also probes for a gone client)
};

// Constant-time comparison of a presented key with the expected one (no early exit on content).
bool keys_equal(const std::string& presented, const std::string& expected);

class HttpServer {
 public:
  HttpServer(const HttpOptions& o, Metrics& m);
  ~HttpServer();
  int bind();    // binds (port 0: a free one) and returns the port; k3::Error on failure
  void serve();  // blocks until stop()
  void stop();

  void set_load_progress(uint64_t done, uint64_t total);
  void set_ready(Engine* e, Scheduler* s, const ApiConfig& cfg);  // after a successful load
  void set_load_failed(const std::string& message);

 private:
  void routes();
  Metrics& metrics_;
  HttpOptions opt_;
  std::unique_ptr<httplib::Server> svr_;
  std::atomic<uint64_t> load_done_{0}, load_total_{0};
  std::atomic<bool> ready_{false};
  std::mutex mu_;
  std::string load_error_;
  Engine* engine_ = nullptr;
  Scheduler* sched_ = nullptr;
  ApiConfig cfg_;
  int64_t started_ = 0;
  std::atomic<uint64_t> next_id_{1};
};

}  // namespace k3::server
