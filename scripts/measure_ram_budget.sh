#!/usr/bin/env bash
# Writes docs/data/ram-budget.json: greedy `k3 run` (32 tokens) on the generated experts-heavy
# checkpoint (routed experts ~10x the trunk; the whole --ram-budget is under half the expert bytes)
# with every weight resident vs under --ram-budget (trunk resident, routed experts
# streamed through an LRU cache smaller than half of them; buffered pread and O_DIRECT), asserting
# the three print the same text. Records tokens/s, peak RSS, expert bytes read per token, hit rate.
# The checkpoint is (re)generated when absent (needs the tools venv); never commit it.
# The default build is CPU-only (build-cpu, K3_CUDA=OFF): a build with the CUDA backend maps the
# CUDA libraries (cuBLAS) at start, which adds their pages to every run's RSS; baseline_rss_bytes
# (`k3 --version`) shows what the binary alone costs. BUILD_DIR=build OUT=... measures a CUDA build.
# Environment: MODEL (default build/experts-heavy), BUILD_DIR (default build-cpu), PYTHON (tools venv python,
# default build/venv/bin/python, created by tools/setup_venv.sh when absent), CACHE (expert cache size in bytes, default 128 MiB), TOKENS (32),
# REPS (runs of each configuration, interleaved; default 3), PRESET (generator preset used when
# MODEL is absent; default experts-heavy), OUT (default docs/data/ram-budget.json).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
model=${MODEL:-build/experts-heavy}
build=${BUILD_DIR:-build-cpu}
cmake_args=()
[[ -n ${BUILD_DIR:-} ]] || cmake_args=(-DCMAKE_BUILD_TYPE=Release -DK3_CUDA=OFF)
py=${PYTHON:-build/venv/bin/python}
cache=${CACHE:-$((128 << 20))}
tokens=${TOKENS:-32}
reps=${REPS:-3}

if [[ ! -f $model/model.safetensors.index.json ]]; then
  [[ -x $py ]] || bash tools/setup_venv.sh
  [[ -x $py ]] || py=build/venv/bin/python
  "$py" tools/gen/gen_tiny_checkpoint.py --preset "${PRESET:-experts-heavy}" --seed 1 --out "$model" --no-reference
fi
cmake -S . -B "$build" "${cmake_args[@]}" >/dev/null && nice -n 19 cmake --build "$build" -j"$(nproc)" --target k3cli >/dev/null

machine="$(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB"
mkdir -p docs/data
python3 - "$build/bin/k3" "$model" "$cache" "$tokens" "$machine" "$reps" "${OUT:-docs/data/ram-budget.json}" <<'PY'
import glob, json, os, re, struct, subprocess, sys, time

k3, model, cache, tokens, machine = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
reps, out_path = int(sys.argv[6]), sys.argv[7]

# Trunk vs routed-expert bytes from the safetensors headers (the engine's split: names with
# ".block_sparse_moe.experts.").
trunk = experts = 0
for f in glob.glob(os.path.join(model, "*.safetensors")):
    with open(f, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(n))
    for name, v in header.items():
        if name == "__metadata__":
            continue
        b = v["data_offsets"][1] - v["data_offsets"][0]
        if ".block_sparse_moe.experts." in name:
            experts += b
        else:
            trunk += b
budget = trunk + cache
assert cache * 2 < experts, "the expert cache must be under half of the experts"

prompt = "The function returns a new object when the database connection is closed, and"
base = [k3, "run", "-m", model, "--tokenizer", "models/k3-nano", "--temp", "0", "--ignore-eos", "-n", str(tokens),
        "-t", str(os.cpu_count()), "-q", "-v", prompt]

def run(extra):
    cmd = base[:2] + extra + base[2:]
    with open("/tmp/k3_rb_out", "wb") as out, open("/tmp/k3_rb_err", "wb") as err:
        t0 = time.time()
        p = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.time() - t0
    text = open("/tmp/k3_rb_out", "rb").read().decode("utf-8", "replace")
    log = open("/tmp/k3_rb_err").read()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit("measure_ram_budget.sh: %s failed:\n%s" % (" ".join(cmd), log))
    summary = [l for l in log.splitlines() if l.startswith("k3 run: prompt ")][-1]
    r = {"flags": " ".join(extra), "wall_seconds": round(wall, 3), "peak_rss_bytes": ru.ru_maxrss * 1024,
         "prefill_tokens_per_second": float(re.search(r"prefill ([\d.]+) tok/s", summary).group(1)),
         "decode_tokens_per_second": float(re.search(r"decode ([\d.]+) tok/s", summary).group(1)),
         "summary": summary}
    m = re.search(r"expert cache (\d+) bytes \((\d+) slots of (\d+)\) for (\d+) bytes of experts; prefill (\d+) tok: "
                  r"(\d+) bytes read; decode (\d+) tok: (\d+) bytes read; (\d+) reads, (\d+) hits, (\d+) misses, "
                  r"(\d+) evictions", log)
    if m:
        cap, slots, slot, exp, pt, pb, dt, db, reads, hits, misses, ev = map(int, m.groups())
        assert exp == experts, (exp, experts)
        r.update({"cache_bytes": cap, "cache_slots": slots, "slot_bytes": slot,
                  "prefill_tokens": pt, "prefill_bytes_read": pb, "prefill_bytes_read_per_token": round(pb / pt),
                  "decode_tokens_fed": dt, "decode_bytes_read": db, "decode_bytes_read_per_token": round(db / dt),
                  "reads": reads, "hits": hits, "misses": misses, "evictions": ev,
                  "hit_rate": round(hits / (hits + misses), 4)})
    return text, r

# What the binary alone holds (its libraries, no model): `k3 --version`.
p = subprocess.Popen([k3, "--version"], stdout=subprocess.DEVNULL)
_, _, ru = os.wait4(p.pid, 0)
baseline_rss = ru.ru_maxrss * 1024

# The three configurations interleaved, `reps` times each (2 shared cores: single runs are noisy);
# throughput is the median over the repetitions, every repetition's figures are kept.
configs = [("unlimited", []), ("budget", ["--ram-budget", str(budget)]),
           ("budget_direct_io", ["--ram-budget", str(budget), "--direct-io"])]
samples = {key: [] for key, _ in configs}
reference = None
for rep in range(reps):
    for key, extra in configs:
        text, r = run(extra)
        if reference is None:
            reference = text
        if text != reference:
            sys.exit("measure_ram_budget.sh: output under %s differs from the unlimited run" % key)
        samples[key].append(r)
        print("%-17s %s" % (key, r["summary"]), file=sys.stderr)

def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2

runs = {}
for key, rs in samples.items():
    r = dict(rs[0])  # the expert counters are the same every repetition (deterministic)
    del r["summary"]
    for f in ("prefill_tokens_per_second", "decode_tokens_per_second", "wall_seconds"):
        r[f] = median([x[f] for x in rs])
        r[f + "_all"] = [x[f] for x in rs]
    r["peak_rss_bytes"] = max(x["peak_rss_bytes"] for x in rs)
    for x in rs[1:]:
        for f in ("prefill_bytes_read", "decode_bytes_read", "hits", "misses"):
            assert x.get(f) == r.get(f), (key, f)
    runs[key] = r

doc = {"command": "bash scripts/measure_ram_budget.sh", "machine": machine, "date": time.strftime("%Y-%m-%d", time.gmtime()),
       "binary": k3, "baseline_rss_bytes": baseline_rss,
       "checkpoint": model, "prompt": prompt, "generated_tokens": tokens,
       "ram_budget_bytes": budget, "trunk_bytes": trunk, "expert_bytes": experts,
       "expert_cache_bytes": cache, "expert_cache_fraction_of_experts": round(cache / experts, 4),
       "expert_bytes_over_ram_budget": round(experts / budget, 3),
       "identical_output": True, "repetitions": reps, "throughput": "median over the repetitions",
       "page_cache": "the shards are in the page cache (the unlimited run reads them all), so buffered expert reads "
       "are memory copies; O_DIRECT reads go to the device", "runs": runs}
with open(out_path, "w") as f:
    json.dump(doc, f, indent=2)
    f.write("\n")
print(json.dumps(doc, indent=2))
PY
