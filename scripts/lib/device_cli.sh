# Shared by the GPU-machine scripts (measure_cuda_perf.sh, gpu_profile.sh): source, then
#   device_start          sets $out ($OUT, or build-cuda-stage/out here) and runs unpack_cli
#   unpack_cli            k3 from build-cuda-stage/cli.tar.xz into /tmp/k3-cuda-cli; sets $k3
#   ensure_gpu_bench DIR  generates the K3-shaped gpu-bench checkpoint into DIR unless it is there
unpack_cli() {
  local bin=/tmp/k3-cuda-cli
  rm -rf "$bin" && mkdir -p "$bin" && xz -dc build-cuda-stage/cli.tar.xz | tar -C "$bin" -xf - ||
    { echo "cannot unpack build-cuda-stage/cli.tar.xz (run bash scripts/cuda_test.sh here first)"; return 2; }
  export LD_LIBRARY_PATH=$bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
  k3=$bin/k3
}
device_start() {
  out=${OUT:-build-cuda-stage/out}
  mkdir -p "$out"
  unpack_cli
}
ensure_gpu_bench() {
  local ckpt=$1 t0
  [[ -f $ckpt/config.json ]] && return 0
  t0=$(date +%s)
  python3 tools/gen/gen_tiny_checkpoint.py --preset gpu-bench --seed 1 --out "$ckpt" --no-reference >/tmp/gen.log 2>&1 ||
    { tail -5 /tmp/gen.log; return 1; }
  echo "generated gpu-bench in $(($(date +%s) - t0)) s: $(du -sh "$ckpt" | cut -f1)"
}
