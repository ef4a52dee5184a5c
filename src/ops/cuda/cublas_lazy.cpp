// cuBLAS, loaded on first use: the k3 binary does not link libcublas (NEEDED), so a process that never
// runs on the GPU (`k3 tokenize`, `k3 info`, every CPU run) never maps its ~200 MiB. The handful of
// cuBLAS entry points the engine calls are defined here with cuBLAS's own prototypes (cublas_api.h)
// and forward to the library opened with dlopen (K3_CUBLAS_SONAME, the soname of the toolkit this
// was built with, found on the loader's path or else in that toolkit's library directory). load_cublas() opens it and
// names the problem in one line when it is missing; make_cuda_backend and the bench probe call it before anything else
// uses cuBLAS. Owns: the dlopen handle and the function pointers. Must not: call CUDA itself.
#include <cublas_v2.h>

#include <mutex>
#include <string>

#include "core/error.h"
#include "ops/cuda/lazy_lib.h"
#include "ops/cuda/runtime.h"

#ifndef K3_CUBLAS_SONAME
#error "K3_CUBLAS_SONAME (e.g. libcublas.so.13) is set by src/ops/CMakeLists.txt"
#endif

namespace {

struct Cublas {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetWorkspace_v2) set_workspace = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
  // cublas_api.h also has a static inline cublasGemmEx taking a cudaDataType compute type: name the
  // library's one by its exact type.
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                            const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                            cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
  bool ok = false;
  std::string error;  // why it could not be loaded (set once tried)
};

#ifdef K3_CUBLAS_BUILD_DIR
constexpr const char* kFallbackDir = K3_CUBLAS_BUILD_DIR;
#else
constexpr const char* kFallbackDir = nullptr;
#endif

const Cublas& cublas() {
  static Cublas c;
  static std::once_flag once;
  std::call_once(once, [] {
    // The loader's search path first (LD_LIBRARY_PATH, ldconfig), then the toolkit this was built with.
    void* lib = k3::cuda::lazy::open(K3_CUBLAS_SONAME, kFallbackDir, &c.error);
    if (!lib) return;
    const auto sym = [&](const char* name, auto& fn) {
      return k3::cuda::lazy::sym(lib, K3_CUBLAS_SONAME, name, fn, &c.error);
    };
    c.ok = sym("cublasCreate_v2", c.create) && sym("cublasDestroy_v2", c.destroy) &&
           sym("cublasSetStream_v2", c.set_stream) && sym("cublasSetWorkspace_v2", c.set_workspace) &&
           sym("cublasGetStatusString", c.status_string) && sym("cublasGemmEx", c.gemm_ex);
  });
  return c;
}

}  // namespace

namespace k3::cuda {

void load_cublas() {
  const Cublas& c = cublas();
  if (!c.ok)
    fail("--device cuda: cannot load cuBLAS (" + c.error + "); install the CUDA " + std::to_string(CUBLAS_VER_MAJOR) +
         " cuBLAS library or put its directory on LD_LIBRARY_PATH");
}

}  // namespace k3::cuda

// The entry points, as cuBLAS declares them. Without the library they report NOT_INITIALIZED.
extern "C" {

cublasStatus_t CUBLASWINAPI cublasCreate_v2(cublasHandle_t* handle) {
  const Cublas& c = cublas();
  return c.ok ? c.create(handle) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t CUBLASWINAPI cublasDestroy_v2(cublasHandle_t handle) {
  const Cublas& c = cublas();
  return c.ok ? c.destroy(handle) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t CUBLASWINAPI cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  const Cublas& c = cublas();
  return c.ok ? c.set_stream(handle, stream) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t CUBLASWINAPI cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t bytes) {
  const Cublas& c = cublas();
  return c.ok ? c.set_workspace(handle, workspace, bytes) : CUBLAS_STATUS_NOT_INITIALIZED;
}

const char* CUBLASWINAPI cublasGetStatusString(cublasStatus_t status) {
  const Cublas& c = cublas();
  return c.ok ? c.status_string(status) : "cuBLAS is not loaded";
}

cublasStatus_t CUBLASWINAPI cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                         int m, int n, int k, const void* alpha, const void* A, cudaDataType Atype,
                                         int lda, const void* B, cudaDataType Btype, int ldb, const void* beta, void* C,
                                         cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                                         cublasGemmAlgo_t algo) {
  const Cublas& c = cublas();
  return c.ok ? c.gemm_ex(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
                          computeType, algo)
              : CUBLAS_STATUS_NOT_INITIALIZED;
}

}  // extern "C"
