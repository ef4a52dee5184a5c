#!/usr/bin/env bash
# Kimi Linear on the CPU, side by side with llama.cpp's own Kimi Linear implementation (issue 21).
#
#   1. builds k3 (CPU-only, build-cpu/) if missing;
#   2. generates the random shrunk checkpoint build/$PRESET (tools/gen/gen_kimi_linear.py, default
#      preset kl-bench: hidden 1536, 8 layers (MLA at 4, 8), 32 experts top-8 + 1 shared, vocab
#      163840, 2.56 GB bf16; never committed) unless it is there already;
#   3. runs scripts/peer_llamacpp.sh on it: llama.cpp's unmodified converter (its KimiLinearModel
#      class; no-vocab GGUF, ids are fed directly), then prefill ppP and decode tgN of both engines
#      with the same ids, threads and weights (bf16 on both), ROUNDS alternating rounds of REPS
#      repetitions each, and the teacher-forced logits cross-check against `k3 logits`;
#   4. writes docs/data/kimi-linear-peer-cpu.json (machine, CPU flags, commit, command, numbers;
#      `summary` has per-engine medians and ranges over the rounds and the k3 / llama.cpp ratios)
#      and docs/data/kimi-linear-peer-cpu-check-f32.json (the same-model check in fp32).
#
# Usage: bash scripts/peer_llamacpp_kimi_linear.sh [extra llamacpp_bench.py options]
# Environment (defaults): PRESET=kl-bench SEED=1 PP=128 TG=32 REPS=2 ROUNDS=4 THREADS=2
#   OUT=docs/data/kimi-linear-peer-cpu.json K3_BIN=build-cpu/bin/k3 PEER_NICE=0 CHECK_F32=1
#   (pp512/tg128 with 4 rounds took over 10 minutes for llama.cpp's first round alone on the busy
#   2-core VM, hence the short defaults; PP=512 TG=128 ROUNDS=4 on a quiet machine)
#   (the other variables of scripts/peer_llamacpp.sh apply: PEER_VENV, TORCH_FROM, ...)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
preset="${PRESET:-kl-bench}"
seed="${SEED:-1}"
pp="${PP:-128}"
tg="${TG:-32}"
reps="${REPS:-2}"
rounds="${ROUNDS:-4}"
threads="${THREADS:-2}"
out="${OUT:-docs/data/kimi-linear-peer-cpu.json}"
export K3_BIN="${K3_BIN:-$repo/build-cpu/bin/k3}"
# the benchmark runs at normal priority: at nice 19 the other jobs of a shared machine take the
# cores and the numbers measure the scheduler; the load average is recorded instead
export PEER_NICE="${PEER_NICE:-0}"

# 0. the peer venv + llama.cpp sources (no-op when present)
bash scripts/peer_llamacpp.sh --setup-only
py="${PEER_VENV:-$repo/build/peer-venv}/bin/python"

# 1. k3 (CPU)
if [ ! -x "$K3_BIN" ]; then
  cmake -S . -B build-cpu -DCMAKE_BUILD_TYPE=Release -DK3_CUDA=OFF -DK3_BUILD_TESTS=OFF
  nice -n 19 cmake --build build-cpu -j2 --target k3
fi

# 2. the checkpoint (regenerated when the generator, preset or seed changed)
ckpt="build/$preset"
want="$(sha256sum tools/gen/gen_kimi_linear.py | cut -d' ' -f1) $preset $seed"
if [ ! -f "$ckpt/.k3cpp-gen-stamp" ] || [ "$(cat "$ckpt/.k3cpp-gen-stamp")" != "$want" ]; then
  rm -f "$ckpt/.k3cpp-gen-stamp"
  nice -n 19 "$py" tools/gen/gen_kimi_linear.py --preset "$preset" --seed "$seed" --out "$ckpt"
  echo "$want" > "$ckpt/.k3cpp-gen-stamp"
fi

cmd="bash scripts/peer_llamacpp_kimi_linear.sh $*"
[ "$preset$seed$pp$tg$reps$rounds$threads" = "kl-bench11283242" ] ||
  cmd="PRESET=$preset SEED=$seed PP=$pp TG=$tg REPS=$reps ROUNDS=$rounds THREADS=$threads $cmd"
[ "$out" = docs/data/kimi-linear-peer-cpu.json ] || cmd="OUT=$out $cmd"
[ "${CHECK_F32:-1}" != 0 ] || cmd="CHECK_F32=0 $cmd"
export PEER_COMMAND="$cmd"

# 3. same model? An F32 GGUF (a lossless widening of the bf16 weights) with an f32 K cache, so
#    that llama.cpp computes in fp32: its teacher-forced logits and 16 greedy tokens against
#    `k3 logits` / `k3 generate` (exact numerics) on 32 seeded random ids. CHECK_F32=0 skips it.
if [ "${CHECK_F32:-1}" != 0 ]; then
  bash scripts/peer_llamacpp.sh "$ckpt" --no-bench -t "$threads" --seed "$seed" --greedy-n 16 \
    --outtype f32 --cache-type f32 --json-out "${out%.json}-check-f32.json" > /dev/null
  echo "wrote ${out%.json}-check-f32.json" >&2
fi

# 4. the benchmark (bf16 GGUF, llama.cpp's default f16 K cache), with the same check on bf16
bash scripts/peer_llamacpp.sh "$ckpt" -p "$pp" -n "$tg" -r "$reps" --rounds "$rounds" -t "$threads" \
  --seed "$seed" --with-k3 --greedy-n 16 --json-out "$out" "$@" > /dev/null
echo "wrote $out" >&2
