// CUDA runtime wrapper (see runtime.h): every CUDA call is checked and turned into k3::Error.
#include "ops/cuda/runtime.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

#include "core/error.h"

namespace k3::cuda {

namespace {
void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();  // clear it, so the next check does not report this failure again
  fail(std::string("CUDA: ") + what + ": " + cudaGetErrorString(e));
}
std::string human_bytes(size_t b) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f GiB", double(b) / (1024.0 * 1024 * 1024));
  return buf;
}
}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

std::string unavailable_reason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    // The runtime reports a machine without any NVIDIA driver as an "insufficient" driver.
    if (e == cudaErrorInsufficientDriver)
      return "no NVIDIA driver, or one older than this build's CUDA " + std::to_string(CUDART_VERSION / 1000) +
             " runtime";
    if (e == cudaErrorNoDevice) return "no CUDA device found";
    return cudaGetErrorString(e);
  }
  return n == 0 ? "no CUDA device found" : "";
}

int sm_count() {
  static const int n = [] {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess || v <= 0) {
      (void)cudaGetLastError();
      v = 132;
    }
    return v;
  }();
  return n;
}

DeviceInfo device_info() {
  if (device_count() == 0) fail("CUDA: no usable GPU: " + unavailable_reason());
  DeviceInfo d;
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, 0), "cudaGetDeviceProperties");
  d.index = 0;
  d.name = p.name;
  d.sm_major = p.major;
  d.sm_minor = p.minor;
  d.multiprocessors = p.multiProcessorCount;
  int clk = 0, bus = 0;
  cudaDeviceGetAttribute(&clk, cudaDevAttrMemoryClockRate, 0);
  cudaDeviceGetAttribute(&bus, cudaDevAttrGlobalMemoryBusWidth, 0);
  d.mem_clock_khz = clk;
  d.bus_width_bits = bus;
  check(cudaMemGetInfo(&d.free_bytes, &d.total_bytes), "cudaMemGetInfo");
  return d;
}

namespace {
struct AllocBook {
  std::mutex mu;
  std::unordered_map<void*, std::pair<size_t, std::string>> sizes;  // size, what
  size_t live = 0, peak = 0;
  std::vector<std::pair<std::string, size_t>> at_peak;  // by `what`, when peak was reached
  void note_peak() {  // (allocations are few and rare: set-up, pool growth)
    std::unordered_map<std::string, size_t> by;
    for (const auto& kv : sizes) by[kv.second.second] += kv.second.first;
    at_peak.assign(by.begin(), by.end());
  }
};
AllocBook& book() {
  static AllocBook* b = new AllocBook();  // never destroyed: buffers may be freed during exit
  return *b;
}
}  // namespace

void* dev_alloc(size_t bytes, const char* what) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    fail(std::string("CUDA: out of GPU memory allocating ") + human_bytes(bytes) + " for " + what + " (" +
         human_bytes(free_b) + " free of " + human_bytes(total_b) + ")");
  }
  AllocBook& b = book();
  std::lock_guard<std::mutex> lock(b.mu);
  b.sizes[p] = {bytes, what ? what : "?"};
  b.live += bytes;
  if (b.live > b.peak) {
    b.peak = b.live;
    b.note_peak();
  }
  return p;
}

void dev_free(void* p) noexcept {
  if (!p) return;
  cudaFree(p);
  AllocBook& b = book();
  std::lock_guard<std::mutex> lock(b.mu);
  const auto it = b.sizes.find(p);
  if (it == b.sizes.end()) return;
  b.live -= it->second.first;
  b.sizes.erase(it);
}

size_t dev_bytes_live() {
  AllocBook& b = book();
  std::lock_guard<std::mutex> lock(b.mu);
  return b.live;
}
size_t dev_bytes_peak() {
  AllocBook& b = book();
  std::lock_guard<std::mutex> lock(b.mu);
  return b.peak;
}
void dev_reset_peak() {
  AllocBook& b = book();
  std::lock_guard<std::mutex> lock(b.mu);
  b.peak = b.live;
  b.note_peak();
}
std::vector<std::pair<std::string, size_t>> dev_peak_breakdown() {
  AllocBook& b = book();
  std::lock_guard<std::mutex> lock(b.mu);
  std::vector<std::pair<std::string, size_t>> v = b.at_peak;
  std::sort(v.begin(), v.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
  return v;
}

void h2d(void* dst, const void* src, size_t bytes, Stream s) {
  if (bytes) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s), "copy to GPU");
}
void d2h(void* dst, const void* src, size_t bytes, Stream s) {
  if (bytes) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s), "copy from GPU");
  check(cudaStreamSynchronize(s), "stream synchronize");
}
void d2d(void* dst, const void* src, size_t bytes, Stream s) {
  if (bytes) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s), "copy on GPU");
}
void dev_memset(void* dst, int value, size_t bytes, Stream s) {
  if (bytes) check(cudaMemsetAsync(dst, value, bytes, s), "memset on GPU");
}
void sync(Stream s) { check(cudaStreamSynchronize(s), "stream synchronize"); }

void check_launch(const char* what) { check(cudaGetLastError(), what); }

Stream stream_create() {
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  return s;
}
void stream_destroy(Stream s) noexcept {
  if (s) cudaStreamDestroy(s);
}

void* host_alloc_pinned(size_t bytes) {
  void* p = nullptr;
  check(cudaMallocHost(&p, bytes), "cudaMallocHost");
  return p;
}
void host_free_pinned(void* p) noexcept {
  if (p) cudaFreeHost(p);
}

void capture_begin(Stream s) {
  check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "begin graph capture");
}
GraphExec capture_end(Stream s) {
  cudaGraph_t g = nullptr;
  check(cudaStreamEndCapture(s, &g), "end graph capture");
  cudaGraphExec_t e = nullptr;
  const cudaError_t r = cudaGraphInstantiate(&e, g, 0);
  cudaGraphDestroy(g);
  check(r, "instantiate graph");
  return e;
}
void graph_launch(GraphExec g, Stream s) { check(cudaGraphLaunch(g, s), "graph launch"); }
void graph_destroy(GraphExec g) noexcept {
  if (g) cudaGraphExecDestroy(g);
}

Event::Event() {
  cudaEvent_t e;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  e_ = e;
}
Event::~Event() { cudaEventDestroy(static_cast<cudaEvent_t>(e_)); }
void Event::record(Stream s) {
  check(cudaEventRecord(static_cast<cudaEvent_t>(e_), s), "event record");
  recorded_ = true;
}
void Event::make_wait(Stream s) {
  if (recorded_) check(cudaStreamWaitEvent(s, static_cast<cudaEvent_t>(e_), 0), "stream wait event");
}
void Event::sync() {
  if (recorded_) check(cudaEventSynchronize(static_cast<cudaEvent_t>(e_)), "event synchronize");
}

EventTimer::EventTimer() {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "cudaEventCreate");
  check(cudaEventCreate(&b), "cudaEventCreate");
  a_ = a;
  b_ = b;
}
EventTimer::~EventTimer() {
  cudaEventDestroy(static_cast<cudaEvent_t>(a_));
  cudaEventDestroy(static_cast<cudaEvent_t>(b_));
}
void EventTimer::start(Stream s) { check(cudaEventRecord(static_cast<cudaEvent_t>(a_), s), "event record"); }
void EventTimer::stop(Stream s) { check(cudaEventRecord(static_cast<cudaEvent_t>(b_), s), "event record"); }
double EventTimer::ms() {
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(b_)), "event synchronize");
  float m = 0;
  check(cudaEventElapsedTime(&m, static_cast<cudaEvent_t>(a_), static_cast<cudaEvent_t>(b_)), "event elapsed");
  return m;
}

EventMarks::~EventMarks() {
  for (void* e : ev_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
}
int64_t EventMarks::record(Stream s) {
  if (next_ == int64_t(ev_.size())) {
    cudaEvent_t e;
    check(cudaEventCreate(&e), "cudaEventCreate");
    ev_.push_back(e);
  }
  check(cudaEventRecord(static_cast<cudaEvent_t>(ev_[size_t(next_)]), s), "event record");
  return next_++;
}
double EventMarks::ms_between(int64_t a, int64_t b) {
  if (a < 0 || b < 0 || a >= next_ || b >= next_) fail("internal error: an event mark that was not recorded");
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(ev_[size_t(b)])), "event synchronize");
  float m = 0;
  check(cudaEventElapsedTime(&m, static_cast<cudaEvent_t>(ev_[size_t(a)]), static_cast<cudaEvent_t>(ev_[size_t(b)])),
        "event elapsed");
  return m;
}

}  // namespace k3::cuda
