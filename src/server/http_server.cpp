// HTTP routes of `k3 serve` over cpp-httplib (see http_server.h).
#include "server/http_server.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <httplib.h>
#include <cerrno>
#include <chrono>
#include <cstdlib>

#include "core/error.h"
#include "server/k3_web_page.h"
#include "server/sse.h"

namespace k3::server {

namespace {

using std::chrono::milliseconds;

std::string addr_string(const sockaddr_storage& a) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (a.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(a).sin_addr, buf, sizeof buf);
  } else if (a.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(a).sin6_addr, buf, sizeof buf);
  }
  return buf;
}
int port_of(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
  return -1;
}

// The socket of this request's connection, found by its address pair among the process's open files
// (cpp-httplib 0.11 gives handlers no socket). Valid while the handler or its content provider runs:
// the library closes the socket only after both. -1 when not found (disconnects are then noticed on
// the next failed write).
int connection_fd(const httplib::Request& req) {
  DIR* d = opendir("/proc/self/fd");
  if (!d) return -1;
  int found = -1;
  while (dirent* ent = readdir(d)) {
    char* end = nullptr;
    const long fd = std::strtol(ent->d_name, &end, 10);
    if (*end || fd < 0) continue;
    sockaddr_storage peer{}, local{};
    socklen_t pl = sizeof peer, ll = sizeof local;
    if (getpeername(int(fd), reinterpret_cast<sockaddr*>(&peer), &pl) != 0) continue;
    if (port_of(peer) != req.remote_port) continue;
    if (getsockname(int(fd), reinterpret_cast<sockaddr*>(&local), &ll) != 0) continue;
    if (port_of(local) != req.local_port) continue;
    const std::string pa = addr_string(peer);
    if (pa != req.remote_addr && ("::ffff:" + req.remote_addr) != pa && pa != ("::ffff:" + req.remote_addr)) continue;
    found = int(fd);
    break;
  }
  closedir(d);
  return found;
}

// True when the client has closed (or reset) the connection: a peek returns end-of-stream or an error.
bool peer_gone(int fd) {
  if (fd < 0) return false;
  char c;
  const ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n == 0) return true;
  if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
  return false;
}

void send_json(httplib::Response& res, int status, const json& j) {
  res.status = status;
  res.set_content(dump(j), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) { send_json(res, e.status, error_json(e)); }

// Waits for deltas or the end of a job (or the client leaving, which cancels it). Returns the deltas
// taken; *finished / *fin when the job ended.
std::deque<Delta> wait_job(Job& j, int fd, bool* finished, Finish* fin, milliseconds slice, bool* gone) {
  std::deque<Delta> out;
  std::unique_lock<std::mutex> l(j.mu);
  j.cv.wait_for(l, slice, [&] { return j.finished || !j.deltas.empty(); });
  out.swap(j.deltas);
  if (j.finished) {
    *finished = true;
    *fin = j.fin;
  }
  l.unlock();
  if (!*finished && peer_gone(fd)) {
    j.cancel.store(true);
    *gone = true;
  }
  return out;
}

}  // namespace

bool keys_equal(const std::string& presented, const std::string& expected) {
  // Every byte of the longer string is visited; the result depends on all of them and on the lengths.
  const size_t n = std::max(presented.size(), expected.size());
  unsigned char diff = presented.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char a = i < presented.size() ? static_cast<unsigned char>(presented[i]) : 0;
    const unsigned char b = i < expected.size() ? static_cast<unsigned char>(expected[i]) : 0;
    diff |= static_cast<unsigned char>(a ^ b);
  }
  return diff == 0;
}

HttpServer::HttpServer(const HttpOptions& o, Metrics& m)
    : metrics_(m), opt_(o), svr_(std::make_unique<httplib::Server>()) {
  started_ = int64_t(std::time(nullptr));
  routes();
}

HttpServer::~HttpServer() { stop(); }

void HttpServer::set_load_progress(uint64_t done, uint64_t total) {
  load_done_.store(done);
  load_total_.store(total);
}

void HttpServer::set_ready(Engine* e, Scheduler* s, const ApiConfig& cfg) {
  std::lock_guard<std::mutex> l(mu_);
  engine_ = e;
  sched_ = s;
  cfg_ = cfg;
  ready_.store(true);
}

void HttpServer::set_load_failed(const std::string& message) {
  std::lock_guard<std::mutex> l(mu_);
  load_error_ = message;
}

int HttpServer::bind() {
  const int threads = opt_.threads;
  svr_->new_task_queue = [threads] { return new httplib::ThreadPool(size_t(std::max(threads, 4))); };
  int port = opt_.port;
  if (port == 0) {
    port = svr_->bind_to_any_port(opt_.host);
    if (port < 0) fail("cannot bind to " + opt_.host + " on any port");
  } else if (!svr_->bind_to_port(opt_.host, port)) {
    fail("cannot bind to " + opt_.host + ":" + std::to_string(port) + " (in use, or not an address of this machine)");
  }
  return port;
}

void HttpServer::serve() { svr_->listen_after_bind(); }

void HttpServer::stop() {
  if (svr_) svr_->stop();
}

void HttpServer::routes() {
  httplib::Server& s = *svr_;
  s.set_payload_max_length(opt_.max_body_bytes);
  s.set_read_timeout(opt_.read_timeout_s, 0);
  s.set_write_timeout(opt_.write_timeout_s, 0);
  s.set_keep_alive_timeout(5);

  s.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!opt_.cors_origin.empty()) {
      res.set_header("Access-Control-Allow-Origin", opt_.cors_origin);
      res.set_header("Vary", "Origin");
      if (req.method == "OPTIONS") {
        res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
        res.set_header("Access-Control-Allow-Headers", "Authorization, Content-Type");
        res.set_header("Access-Control-Max-Age", "600");
        res.status = 204;
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    if (opt_.api_key.empty() || req.path == "/" || req.path == "/health")
      return httplib::Server::HandlerResponse::Unhandled;
    const std::string auth = req.get_header_value("Authorization");
    const std::string prefix = "Bearer ";
    const bool ok = auth.size() > prefix.size() && auth.compare(0, prefix.size(), prefix) == 0 &&
                    keys_equal(auth.substr(prefix.size()), opt_.api_key);
    if (ok) return httplib::Server::HandlerResponse::Unhandled;
    res.set_header("WWW-Authenticate", "Bearer");
    send_json(res, 401,
              error_json(401, auth.empty() ? "missing API key: send Authorization: Bearer KEY" : "invalid API key", "",
                         "invalid_api_key"));
    metrics_.request_done(req.path, 401);
    return httplib::Server::HandlerResponse::Handled;
  });

  s.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty() || res.status == 204) return httplib::Server::HandlerResponse::Unhandled;
    std::string msg;
    switch (res.status) {
      case 404:
        msg = "no route for " + req.method + " " + req.path;
        break;
      case 413:
        msg =
            "the request body is larger than this server's limit of " + std::to_string(opt_.max_body_bytes) + " bytes";
        break;
      case 400:
        msg = "malformed HTTP request";
        break;
      default:
        msg = "HTTP error " + std::to_string(res.status);
    }
    send_json(res, res.status, error_json(res.status, msg, "", res.status == 404 ? "not_found" : ""));
    metrics_.request_done(res.status == 404 ? "unknown" : req.path, res.status);
    return httplib::Server::HandlerResponse::Handled;
  }));

  s.set_exception_handler([this](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_json(res, 500, error_json(500, "internal error: " + what));
    metrics_.request_done(req.path, 500);
  });

  s.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_header("Content-Security-Policy",
                   "default-src 'self'; style-src 'unsafe-inline'; script-src 'unsafe-inline'");
    res.set_header("X-Content-Type-Options", "nosniff");
    res.set_content(kWebPage, sizeof(kWebPage) - 1, "text/html; charset=utf-8");
  });

  s.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    std::string err;
    {
      std::lock_guard<std::mutex> l(mu_);
      err = load_error_;
    }
    if (ready_.load()) {
      send_json(res, 200, json{{"status", "ok"}});
    } else if (!err.empty()) {
      send_json(res, 500, json{{"status", "error"}, {"error", {{"message", err}, {"type", "server_error"}}}});
    } else {
      const uint64_t d = load_done_.load(), t = load_total_.load();
      json j = {{"status", "loading"}, {"progress", t ? double(d) / double(t) : 0.0}};
      j["error"] = {{"message", "the model is loading"}, {"type", "unavailable_error"}, {"code", "loading"}};
      send_json(res, 503, j);
    }
  });

  // Guards the model-backed routes: 503 while loading.
  const auto ready_or_503 = [this](httplib::Response& res) {
    if (ready_.load()) return true;
    send_json(res, 503, error_json(503, "the model is still loading (see /health)", "", "loading"));
    return false;
  };

  s.Get("/v1/models", [this, ready_or_503](const httplib::Request& req, httplib::Response& res) {
    if (!ready_or_503(res)) return;
    send_json(res, 200, models_json(cfg_, started_));
    metrics_.request_done(req.path, 200);
  });

  s.Get("/metrics", [this](const httplib::Request& req, httplib::Response& res) {
    res.set_content(metrics_.expose(), "text/plain; version=0.0.4; charset=utf-8");
    metrics_.request_done(req.path, 200);
  });

  s.Post("/tokenize", [this, ready_or_503](const httplib::Request& req, httplib::Response& res) {
    if (!ready_or_503(res)) return;
    try {
      const json b = parse_body(req.body);
      if (!b.is_object()) throw ApiError(400, "the request body must be a JSON object");
      std::vector<int32_t> ids;
      if (b.contains("messages")) {
        ids = render_chat_ids(b, *engine_);
      } else {
        if (!b.contains("content") || !b["content"].is_string())
          throw ApiError(400, "content must be a string (or give messages)", "content", "invalid_type");
        ids = engine_->tokenize(b["content"].get<std::string>());
      }
      json out = {{"tokens", ids}};
      if (b.value("with_pieces", false)) {
        json pieces = json::array();
        for (int32_t id : ids) pieces.push_back(json{{"id", id}, {"piece", engine_->detokenize({id})}});
        out["pieces"] = pieces;
      }
      send_json(res, 200, out);
    } catch (const ApiError& e) {
      send_error(res, e);
    }
    metrics_.request_done(req.path, res.status);
  });

  s.Post("/detokenize", [this, ready_or_503](const httplib::Request& req, httplib::Response& res) {
    if (!ready_or_503(res)) return;
    try {
      const json b = parse_body(req.body);
      if (!b.is_object() || !b.contains("tokens") || !b["tokens"].is_array())
        throw ApiError(400, "tokens must be an array of token ids", "tokens", "invalid_type");
      std::vector<int32_t> ids;
      for (const auto& x : b["tokens"]) {
        if (!x.is_number_integer())
          throw ApiError(400, "tokens must be an array of token ids", "tokens", "invalid_type");
        const int64_t v = x.get<int64_t>();
        if (v < 0 || v >= engine_->vocab_size())
          throw ApiError(400, "token id " + std::to_string(v) + " is outside the vocabulary", "tokens",
                         "invalid_value");
        ids.push_back(int32_t(v));
      }
      std::string text;
      try {
        text = engine_->detokenize(ids);
      } catch (const std::exception& e) {
        throw ApiError(400, e.what(), "tokens", "invalid_value");
      }
      send_json(res, 200, json{{"content", text}});
    } catch (const ApiError& e) {
      send_error(res, e);
    }
    metrics_.request_done(req.path, res.status);
  });

  const auto generate = [this, ready_or_503](const httplib::Request& req, httplib::Response& res, bool chat) {
    const std::string endpoint = req.path;
    if (!ready_or_503(res)) {
      metrics_.request_done(endpoint, 503);
      return;
    }
    ApiRequest ar;
    try {
      const json b = parse_body(req.body);
      ar = chat ? map_chat_request(b, *engine_, cfg_) : map_completion_request(b, *engine_, cfg_);
    } catch (const ApiError& e) {
      send_error(res, e);
      metrics_.request_done(endpoint, e.status);
      return;
    }
    auto job = std::make_shared<Job>();
    job->id = next_id_++;
    std::vector<int32_t> prompt_ids = ar.gen.prompt;
    job->req = std::move(ar.gen);
    const int fd = connection_fd(req);
    if (!sched_->submit(job)) {
      send_json(res, 429,
                error_json(429,
                           "too many requests are waiting (" + std::to_string(sched_->options().max_queue) +
                               " queued); retry later",
                           "", "queue_full"));
      metrics_.request_done(endpoint, 429);
      return;
    }
    const int64_t created = int64_t(std::time(nullptr));
    const std::string id = random_id(chat ? "chatcmpl-" : "cmpl-");
    std::shared_ptr<ChatResponder> cr;
    std::shared_ptr<CompletionResponder> pr;
    if (chat) {
      cr = std::make_shared<ChatResponder>(*engine_, id, ar.model, created, ar.logprobs);
    } else {
      std::vector<int32_t> echo_ids;
      if (ar.echo) echo_ids = prompt_ids;
      pr = std::make_shared<CompletionResponder>(*engine_, id, ar.model, created, ar.logprobs,
                                                 std::max(0, job->req.top_logprobs), ar.echo ? ar.echo_text : "",
                                                 echo_ids);
    }
    const auto to_chunk = [cr, pr](const Delta& d) { return cr ? cr->chunk(d) : pr->chunk(d); };

    if (!ar.stream) {
      bool finished = false, gone = false;
      Finish fin;
      while (!finished && !gone) {
        for (const Delta& d : wait_job(*job, fd, &finished, &fin, milliseconds(20), &gone)) to_chunk(d);
      }
      if (gone) {
        res.status = 499;
        metrics_.request_done(endpoint, 499);
        return;
      }
      if (fin.reason == "stop" || fin.reason == "length" || fin.reason == "tool_calls") {
        send_json(res, 200, cr ? cr->response(fin) : pr->response(fin));
      } else {
        send_json(res, fin.status, error_json(fin.status, fin.error, "", fin.reason));
      }
      metrics_.request_done(endpoint, res.status);
      return;
    }

    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    const bool include_usage = ar.include_usage;
    const double keepalive = opt_.keepalive_s;
    Metrics* metrics = &metrics_;
    res.set_chunked_content_provider(
        "text/event-stream",
        [job, cr, pr, to_chunk, fd, include_usage, keepalive, metrics, endpoint](size_t, httplib::DataSink& sink) {
          const auto write = [&](const std::string& text) { return sink.write(text.data(), text.size()); };
          const auto with_usage = [&](json c) {
            if (include_usage) c["usage"] = nullptr;
            return c;
          };
          if (cr && !write(sse_data(dump(with_usage(cr->first_chunk()))))) {
            job->cancel.store(true);
            return false;
          }
          bool finished = false, gone = false;
          Finish fin;
          auto last_write = Clock::now();
          while (!finished) {
            const auto deltas = wait_job(*job, fd, &finished, &fin, milliseconds(20), &gone);
            if (gone) {
              metrics->request_done(endpoint, 499);
              return false;
            }
            for (const Delta& d : deltas) {
              if (auto c = to_chunk(d)) {
                if (!write(sse_data(dump(with_usage(*c))))) {
                  job->cancel.store(true);
                  metrics->request_done(endpoint, 499);
                  return false;
                }
                last_write = Clock::now();
              }
            }
            if (!finished && std::chrono::duration<double>(Clock::now() - last_write).count() > keepalive) {
              if (!write(sse_comment("keep-alive"))) {
                job->cancel.store(true);
                return false;
              }
              last_write = Clock::now();
            }
          }
          if (fin.reason == "stop" || fin.reason == "length" || fin.reason == "tool_calls") {
            write(sse_data(dump(with_usage(cr ? cr->final_chunk(fin) : pr->final_chunk(fin)))));
            if (include_usage) write(sse_data(dump(cr ? cr->usage_chunk(fin) : pr->usage_chunk(fin))));
            metrics->request_done(endpoint, 200);
          } else {
            write(sse_data(dump(error_json(fin.status, fin.error, "", fin.reason))));
            metrics->request_done(endpoint, fin.status);
          }
          write(sse_done());
          sink.done();
          return true;
        },
        [job](bool success) {
          if (!success) job->cancel.store(true);
        });
  };

  s.Post("/v1/chat/completions",
         [generate](const httplib::Request& req, httplib::Response& res) { generate(req, res, true); });
  s.Post("/v1/completions",
         [generate](const httplib::Request& req, httplib::Response& res) { generate(req, res, false); });
}

}  // namespace k3::server
