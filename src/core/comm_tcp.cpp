// The TCP rendezvous group (comm_tcp.h): sockets between rank 0 and every other rank (a star).
#include "core/comm_tcp.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "core/error.h"

namespace k3::tcp {

namespace {

constexpr uint32_t kMagic = 0x6b337463u;  // "k3tc"

struct Hello {
  uint32_t magic;
  int32_t rank, world;
};

// "HOST:PORT" (HOST may be [v6]) -> host, port.
std::pair<std::string, std::string> split_host_port(const std::string& hp) {
  const auto colon = hp.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == hp.size())
    fail("--master " + hp + ": give HOST:PORT (e.g. 10.0.0.1:29500)");
  std::string host = hp.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return {host, hp.substr(colon + 1)};
}

addrinfo* resolve(const std::string& hp, bool passive) {
  const auto [host, port] = split_host_port(hp);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) fail("--master " + hp + ": " + ::gai_strerror(rc));
  return res;
}

// Whole-buffer send / receive; false when the peer is gone.
bool send_all(int fd, const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  while (n) {
    const ssize_t k = ::send(fd, b, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    b += k, n -= size_t(k);
  }
  return true;
}
bool recv_all(int fd, void* p, size_t n) {
  auto* b = static_cast<uint8_t*>(p);
  while (n) {
    const ssize_t k = ::recv(fd, b, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    b += k, n -= size_t(k);
  }
  return true;
}

void no_delay(int fd) {
  int one = 1;
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

class TcpComm final : public Communicator {
 public:
  // peers[r]: the socket to rank r (rank 0: every other rank's; others: peers[0] only).
  TcpComm(int rank, int world, std::vector<int> peers) : rank_(rank), world_(world), peers_(std::move(peers)) {}
  ~TcpComm() override { close_all(); }
  int rank() const override { return rank_; }
  int size() const override { return world_; }
  const char* name() const override { return "tcp"; }

  void all_reduce_sum(float*, int64_t) override { no_floats(); }
  void all_gather(const float*, int64_t, float*) override { no_floats(); }
  void all_gather_v(const float*, int64_t, float*, const int64_t*) override { no_floats(); }
  void reduce_scatter_sum(const float*, int64_t, float*) override { no_floats(); }
  void broadcast(float*, int64_t, int) override { no_floats(); }

  void barrier() override {
    uint8_t b = 1;
    if (rank_ == 0) {
      for (int r = 1; r < world_; ++r) check(recv_all(peers_[size_t(r)], &b, 1), r);
      for (int r = 1; r < world_; ++r) check(send_all(peers_[size_t(r)], &b, 1), r);
    } else {
      check(send_all(peers_[0], &b, 1), 0);
      check(recv_all(peers_[0], &b, 1), 0);
    }
  }

  void broadcast_bytes(std::vector<uint8_t>& buf, int root) override {
    if (root != 0) fail("broadcast_bytes: the TCP group broadcasts from rank 0 only");
    if (rank_ == 0) {
      const uint64_t n = buf.size();
      for (int r = 1; r < world_; ++r)
        check(send_all(peers_[size_t(r)], &n, sizeof n) && send_all(peers_[size_t(r)], buf.data(), buf.size()), r);
      return;
    }
    uint64_t n = 0;
    check(recv_all(peers_[0], &n, sizeof n), 0);  // a blocking wait: an idle follower uses no CPU
    if (n > (uint64_t(1) << 40)) fail("broadcast_bytes: a message of " + std::to_string(n) + " bytes from rank 0");
    buf.resize(size_t(n));
    check(recv_all(peers_[0], buf.data(), buf.size()), 0);
  }

  // (No message here: this process reports its own error; the others report the connection's end.)
  void abort(const std::string&) override { close_all(); }  // the others' next receive ends: they fail too

 private:
  [[noreturn]] static void no_floats() {
    fail(
        "ranks started with --master have no host collectives: GPU ranks exchange their data through NCCL; start "
        "CPU ranks as processes with mpirun");
  }
  void check(bool ok, int peer) const {
    if (!ok)
      fail("the connection between rank " + std::to_string(rank_) + " and rank " + std::to_string(peer) +
           " ended (that process stopped or failed)");
  }
  void close_all() {
    for (int& fd : peers_)
      if (fd >= 0) ::shutdown(fd, SHUT_RDWR), ::close(fd), fd = -1;
  }
  int rank_, world_;
  std::vector<int> peers_;
};

}  // namespace

Listener::Listener(const std::string& host_port) : where_(host_port) {
  addrinfo* res = resolve(host_port, true);
  std::string why = "no address";
  for (addrinfo* a = res; a; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    (void)::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) {
      fd_ = fd;
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0)
        port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6&>(ss).sin6_port
                                               : reinterpret_cast<sockaddr_in&>(ss).sin_port);
      break;
    }
    why = std::strerror(errno);
    ::close(fd);
  }
  ::freeaddrinfo(res);
  if (fd_ < 0) fail("--master " + host_port + ": rank 0 cannot listen there (" + why + ")");
}

Listener::~Listener() {
  if (fd_ >= 0) ::close(fd_);
}

std::unique_ptr<Communicator> Listener::accept(int world, double timeout_s) {
  if (world < 2 || world > 1024) fail("--world " + std::to_string(world) + ": 2 to 1024 processes");
  std::vector<int> peers(size_t(world), -1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int joined = 1;
  const auto give_up = [&](const std::string& why) {
    for (int& fd : peers)
      if (fd >= 0) ::close(fd);
    fail(why);
  };
  while (joined < world) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd p{fd_, POLLIN, 0};
    if (left.count() <= 0 || ::poll(&p, 1, int(left.count())) == 0) {
      std::string missing;
      for (int r = 1; r < world; ++r)
        if (peers[size_t(r)] < 0) missing += (missing.empty() ? "" : ",") + std::to_string(r);
      give_up("rank 0 waited " + std::to_string(int(timeout_s)) + " s at " + where_ + " for rank(s) " + missing +
              " to connect");
    }
    const int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Hello h{};
    pollfd q{fd, POLLIN, 0};  // a connection that says nothing for 10 s is not a k3 rank
    if (::poll(&q, 1, 10000) != 1 || !recv_all(fd, &h, sizeof h) || h.magic != kMagic) {
      ::close(fd);  // not a k3 rank (a port scanner, another program): ignored
      continue;
    }
    if (h.world != world || h.rank < 1 || h.rank >= world || peers[size_t(h.rank)] >= 0) ::close(fd);
    if (h.world != world)
      give_up("rank " + std::to_string(h.rank) + " was started with --world " + std::to_string(h.world) +
              ", rank 0 with --world " + std::to_string(world));
    if (h.rank < 1 || h.rank >= world || peers[size_t(h.rank)] >= 0)
      give_up("two processes were started as rank " + std::to_string(h.rank) + " (or it is out of range)");
    no_delay(fd);
    peers[size_t(h.rank)] = fd;
    ++joined;
  }
  const Hello ok{kMagic, 0, world};
  for (int r = 1; r < world; ++r)
    if (!send_all(peers[size_t(r)], &ok, sizeof ok)) give_up("rank " + std::to_string(r) + " left during start-up");
  return std::make_unique<TcpComm>(0, world, std::move(peers));
}

std::unique_ptr<Communicator> connect(int rank, int world, const std::string& host_port, double timeout_s) {
  if (rank < 1 || rank >= world) fail("--rank " + std::to_string(rank) + " of --world " + std::to_string(world));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  std::string why;
  for (;;) {
    addrinfo* res = resolve(host_port, false);
    int fd = -1;
    for (addrinfo* a = res; a && fd < 0; a = a->ai_next) {
      fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
        why = std::strerror(errno);
        ::close(fd);
        fd = -1;
      }
    }
    ::freeaddrinfo(res);
    if (fd >= 0) {
      no_delay(fd);
      const Hello h{kMagic, rank, world};
      Hello ok{};
      if (send_all(fd, &h, sizeof h) && recv_all(fd, &ok, sizeof ok) && ok.magic == kMagic) {
        std::vector<int> peers(size_t(world), -1);
        peers[0] = fd;
        return std::make_unique<TcpComm>(rank, world, std::move(peers));
      }
      ::close(fd);
      fail("rank " + std::to_string(rank) + ": rank 0 at " + host_port +
           " ended the start-up (see its message: another --world, or this rank taken)");
    }
    if (std::chrono::steady_clock::now() >= deadline)
      fail("rank " + std::to_string(rank) + ": cannot reach rank 0 at " + host_port + " within " +
           std::to_string(int(timeout_s)) + " s (" + why + ")");
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

std::unique_ptr<Communicator> rendezvous(int rank, int world, const std::string& master) {
  if (world < 2) fail("--world " + std::to_string(world) + ": a rendezvous needs 2 or more processes");
  if (rank < 0 || rank >= world) fail("--rank " + std::to_string(rank) + " of --world " + std::to_string(world));
  if (rank == 0) return Listener(master).accept(world);
  return connect(rank, world, master);
}

}  // namespace k3::tcp
