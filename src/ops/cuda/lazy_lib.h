// A shared library opened on first use (cuBLAS, NCCL: ops/cuda/*_lazy.cpp), so the k3 binary does
// not link it and processes that never need it never load it. Header-only, host code.
#pragma once
#include <dlfcn.h>

#include <string>

namespace k3::cuda::lazy {

// dlopen(soname) on the loader's path (LD_LIBRARY_PATH, ldconfig), then in fallback_dir (the CUDA
// toolkit this was built with; may be null). Null with *error set when neither opens.
inline void* open(const char* soname, const char* fallback_dir, std::string* error) {
  void* lib = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
  if (lib) return lib;
  const char* e = dlerror();
  *error = e ? e : "dlopen failed";
  if (!fallback_dir) return nullptr;
  lib = dlopen((std::string(fallback_dir) + "/" + soname).c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib) error->clear();
  return lib;
}

// fn <- the library's `name`; false with *error = "<soname> has no <name>" when it lacks it.
template <class Fn>
bool sym(void* lib, const char* soname, const char* name, Fn& fn, std::string* error) {
  fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (!fn) *error = std::string(soname) + " has no " + name;
  return fn != nullptr;
}

}  // namespace k3::cuda::lazy
