// Host-side CUDA runtime wrapper for k3: device discovery, device memory, copies, streams, events
// and graph capture. Plain C++ header (no CUDA includes), so model/ and cli/ can use it.
// Owns: the single place that turns CUDA error codes into k3::Error (one line naming the call).
// Must not: hold model knowledge. Built only when K3_CUDA is on (ops/cuda/runtime.cu).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

struct CUstream_st;
struct CUgraphExec_st;

namespace k3::cuda {

using Stream = CUstream_st*;  // == cudaStream_t

struct DeviceInfo {
  int index = 0;
  std::string name;
  int sm_major = 0, sm_minor = 0, multiprocessors = 0;
  size_t total_bytes = 0, free_bytes = 0;
  double mem_clock_khz = 0;  // peak memory clock (kHz) as reported
  int bus_width_bits = 0;
  // Peak HBM bandwidth from clock × bus width (datasheet-style lead; bench measures the real one).
  double peak_bandwidth_gbs() const { return 2.0 * mem_clock_khz * 1e3 * bus_width_bits / 8 / 1e9; }
};

// Number of usable CUDA devices (0 when the driver is missing or no GPU is present: never throws).
int device_count();
// The device the process uses (0), with its free memory read now. k3::Error if none.
DeviceInfo device_info();
// Multiprocessors of the current device (cached on first use; 132, an H200's, when the query fails):
// what kernels size their grids by. Never throws.
int sm_count();
// Why no device is usable (driver/runtime message), for one-line errors and test skips.
std::string unavailable_reason();
// Opens cuBLAS (dlopen, once; ops/cuda/cublas_lazy.cpp): the binary does not link it, so processes
// that stay on the CPU never load it. k3::Error naming the library when it cannot be loaded.
void load_cublas();

// Device collectives of a model split over processes, one GPU each (issue 23): NCCL, opened on
// first use like cuBLAS (ops/cuda/nccl_lazy.cpp: the binary does not link libnccl). Every call names
// the problem in one k3::Error line (library missing, an NCCL error). Buffers are device memory; the
// collectives are queued on stream s. All ranks call the same collectives in the same order.
struct NcclComm;
std::vector<uint8_t> nccl_unique_id();                                      // rank 0 makes it
NcclComm* nccl_init(const std::vector<uint8_t>& id, int ranks, int rank);  // every rank, together
void nccl_destroy(NcclComm* c) noexcept;
// out[r * n ..] <- rank r's send[0 .. n) (in place allowed: send == out + rank * n).
void nccl_all_gather(NcclComm* c, const float* send, int64_t n, float* out, Stream s);
void nccl_broadcast(NcclComm* c, float* buf, int64_t n, int root, Stream s);
// out <- rank 0's counts[0] floats, rank 1's counts[1], ... (one broadcast per rank, grouped).
void nccl_all_gather_v(NcclComm* c, const float* send, float* out, const int64_t* counts, int ranks, int rank,
                       Stream s);

// Device memory. dev_alloc throws k3::Error naming the size and what was asked for on failure.
void* dev_alloc(size_t bytes, const char* what);
void dev_free(void* p) noexcept;
// What dev_alloc has handed out and not yet been given back (this process, all devices), and the most
// that ever was at once since the last reset: the engine's own device memory, without the CUDA
// context and libraries (cudaMemGetInfo sees those too). For checking the memory plan.
size_t dev_bytes_live();
size_t dev_bytes_peak();
void dev_reset_peak();
// What the peak was made of: bytes by dev_alloc's `what`, largest first (the same reset).
std::vector<std::pair<std::string, size_t>> dev_peak_breakdown();
void h2d(void* dst, const void* src, size_t bytes, Stream s = nullptr);  // async on s, then the
void d2h(void* dst, const void* src, size_t bytes, Stream s = nullptr);  // d2h variant syncs s
void d2d(void* dst, const void* src, size_t bytes, Stream s = nullptr);
void dev_memset(void* dst, int value, size_t bytes, Stream s = nullptr);
void sync(Stream s = nullptr);
// Throws k3::Error("CUDA: <what>: <message>") if the last launch failed.
void check_launch(const char* what);

// A device buffer that frees itself (move-only).
class DevBuf {
 public:
  DevBuf() = default;
  DevBuf(size_t bytes, const char* what) : p_(dev_alloc(bytes, what)), n_(bytes) {}
  ~DevBuf() { dev_free(p_); }
  DevBuf(DevBuf&& o) noexcept : p_(o.p_), n_(o.n_) {
    o.p_ = nullptr;
    o.n_ = 0;
  }
  DevBuf& operator=(DevBuf&& o) noexcept {
    if (this != &o) {
      dev_free(p_);
      p_ = o.p_;
      n_ = o.n_;
      o.p_ = nullptr;
      o.n_ = 0;
    }
    return *this;
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  void* get() const { return p_; }
  size_t bytes() const { return n_; }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

Stream stream_create();
void stream_destroy(Stream s) noexcept;

// Pinned host memory (for async copies the graph replays can read).
void* host_alloc_pinned(size_t bytes);
void host_free_pinned(void* p) noexcept;

// Graph capture of everything enqueued on `s` between begin and end.
using GraphExec = CUgraphExec_st*;
void capture_begin(Stream s);
GraphExec capture_end(Stream s);  // instantiated graph
void graph_launch(GraphExec g, Stream s);
void graph_destroy(GraphExec g) noexcept;

// Elapsed milliseconds of work enqueued by `fn`-style regions: record, then read after sync.
class EventTimer {
 public:
  EventTimer();
  ~EventTimer();
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;
  void start(Stream s);
  void stop(Stream s);
  double ms();  // waits for the stop event

 private:
  void* a_ = nullptr;
  void* b_ = nullptr;
};

// An ordering point between streams (no timing): record on one stream; another stream, or the host,
// waits for the work enqueued before it.
class Event {
 public:
  Event();
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(Stream s);
  void make_wait(Stream s);  // work enqueued on s from now on starts after the recorded point
  void sync();               // the host waits for the recorded point (no-op before the first record)

 private:
  void* e_ = nullptr;
  bool recorded_ = false;
};

// Points marked on a stream and the device time between two of them (per-op profiles of a step:
// k3 bench --profile). Events are created as needed and reused after reset().
class EventMarks {
 public:
  EventMarks() = default;
  ~EventMarks();
  EventMarks(const EventMarks&) = delete;
  EventMarks& operator=(const EventMarks&) = delete;
  int64_t record(Stream s);                 // the mark's handle
  double ms_between(int64_t a, int64_t b);  // waits for mark b
  void reset() { next_ = 0; }

 private:
  std::vector<void*> ev_;
  int64_t next_ = 0;
};

}  // namespace k3::cuda

namespace k3::cuda {
// Roofline probes for `k3 bench --device cuda` (ops/cuda/roofline.cu), measured in the same run:
// device-to-device copy bandwidth (bytes read + written per second, best of several copies of a
// `bytes` buffer, GB/s) and the bf16 tensor-core GEMM rate through cuBLAS on random data (TFLOP/s).
double measure_copy_gbs(size_t bytes);
double measure_bf16_gemm_tflops(int n);
}  // namespace k3::cuda
