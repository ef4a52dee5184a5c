#!/usr/bin/env bash
# Writes docs/data/k3-nano-fp8-trunk.json: what --trunk-fp8 (issue 20) does to K3-nano on this machine.
#  * perplexity on the published validation split (build/corpus/valid.txt, the 202,476-token split of
#    docs/data/k3-nano-chat-eval.json; models/k3-nano/CORPUS.md builds it; its sha256 is checked
#    against docs/data/k3-nano-corpus.json) with `k3 eval --ctx 512 --stride 512`, in the default
#    (fast) and exact numerics, with and without --trunk-fp8;
#  * the trunk's bytes before -> after and the weights held (k3 bench's JSON);
#  * decode (tg128) and prefill (pp128) t/s by `k3 bench`, ROUNDS alternating rounds of -r 5 each
#    (median and range of the rounds' averages), with and without --trunk-fp8.
#  * RSS before/after the quantisation with every page of the mapping read in first: the line of
#    tests/model/test_trunk_fp8 (TrunkFp8.ReleasesTheReplacedPages; a build with K3_BUILD_TESTS=ON).
# Usage: bash scripts/measure_fp8_trunk.sh   (BUILD=build-dir, VALID=path/to/valid.txt, ROUNDS=5,
# SKIP_EXACT=1 to leave the two exact-numerics evals out: they take ~12 min each on 2 cores;
# RSS_ONLY=1 to (re)measure only the RSS and update that key of an existing record)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build}
valid=${VALID:-build/corpus/valid.txt}
rounds=${ROUNDS:-5}
out=docs/data/k3-nano-fp8-trunk.json
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# RSS: the test prints "k3-nano: RSS A MiB -> B MiB; trunk ... released, S s".
measure_rss() {
  cmake --build "$build" -j"$(nproc)" --target test_trunk_fp8 >/dev/null
  local line
  line=$("$build/tests/model/test_trunk_fp8" --gtest_filter=TrunkFp8.ReleasesTheReplacedPages | grep '^k3-nano: RSS')
  python3 - "$out" "$line" <<'PY'
import json, re, sys, subprocess
out, line = sys.argv[1], sys.argv[2]
m = re.match(r"k3-nano: RSS ([0-9.]+) MiB -> ([0-9.]+) MiB; trunk ([0-9.]+) MiB -> ([0-9.]+) MiB FP8, "
             r"([0-9.]+) MiB of mapped pages released, ([0-9.]+) s", line)
d = json.load(open(out))
d["rss"] = {"how": "tests/model/test_trunk_fp8 --gtest_filter=TrunkFp8.ReleasesTheReplacedPages: Model::load, "
                   "Checkpoint::prefault of every page, /proc/self/statm before and after quantize_trunk_fp8()",
            "line": line, "rss_before_mib": float(m[1]), "rss_after_mib": float(m[2]),
            "released_mib": float(m[5]), "quantise_seconds": float(m[6]),
            "commit": subprocess.run("git describe --always --dirty --abbrev=7", shell=True, capture_output=True,
                                     text=True).stdout.strip()}
json.dump(d, open(out, "w"), indent=2)
open(out, "a").write("\n")
PY
}
if [[ ${RSS_ONLY:-0} == 1 ]]; then
  measure_rss
  echo "updated rss in $out" >&2
  exit 0
fi

want=$(python3 -c 'import json; print(json.load(open("docs/data/k3-nano-corpus.json"))["valid_sha256"])')
[[ -f $valid ]] || { echo "no $valid: build it with models/k3-nano/CORPUS.md, steps 1-3 (or set VALID=)" >&2; exit 2; }
have=$(sha256sum "$valid" | cut -d' ' -f1)
[[ $have == "$want" ]] || { echo "$valid has sha256 $have, not the published split's $want" >&2; exit 2; }

cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j"$(nproc)" --target k3cli >/dev/null
k3=$build/bin/k3
nano=models/k3-nano

# Perplexity: every numerics x trunk; the FP8 runs also keep their load line (what was quantised).
numerics=(fast exact)
[[ ${SKIP_EXACT:-0} == 1 ]] && numerics=(fast)
for n in "${numerics[@]}"; do
  for t in bf16 fp8; do
    flag=; [[ $t == fp8 ]] && flag=--trunk-fp8
    echo "eval: numerics $n, trunk $t" >&2
    "$k3" eval -m "$nano" -f "$valid" --ctx 512 --stride 512 --numerics "$n" $flag --json "$tmp/eval-$n-$t.json" \
      2> "$tmp/eval-$n-$t.err" > "$tmp/eval-$n-$t.out"
  done
done

# Speed: alternating rounds, so both options see the same moments of a shared machine.
for r in $(seq 1 "$rounds"); do
  for t in bf16 fp8; do
    flag=; [[ $t == fp8 ]] && flag=--trunk-fp8
    echo "bench round $r: trunk $t" >&2
    "$k3" bench -m "$nano" -p 128 -n 128 -r 5 -o json --no-progress $flag --json-out "$tmp/bench-$t-$r.json" >/dev/null
  done
done

python3 - "$tmp" "$rounds" "$valid" "${numerics[*]}" > "$out" <<'PY'
import json, sys, subprocess, datetime, statistics, glob, os
tmp, rounds, valid, numerics = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4].split()
sh = lambda c: subprocess.run(c, shell=True, capture_output=True, text=True).stdout.strip()
cpu = sh("lscpu | sed -n 's/^Model name: *//p' | head -1")
flags = sh("grep -m1 '^flags' /proc/cpuinfo")
out = {
    "command": "bash scripts/measure_fp8_trunk.sh",
    "date": datetime.date.today().isoformat(),
    "machine": f"{cpu}, {os.cpu_count()} cores (dev VM)"
               + (", AVX-512 BF16/VNNI (k3's avx512 level)" if "avx512_bf16" in flags else ""),
    "commit": sh("git describe --always --dirty --abbrev=7"),  # -dirty: the tree had uncommitted changes
    "model": "models/k3-nano",
    "format": "trunk matrices in FP8: E4M3 codes + one fp32 scale per 128 x 128 block (scale = block max|w| / 448), "
              "quantised at load from BF16; router, MXFP4 routed experts, embedding and lm_head unchanged",
}
ev = {}
for n in numerics:
    row = {}
    for t in ("bf16", "fp8"):
        e = json.load(open(f"{tmp}/eval-{n}-{t}.json"))
        row[t] = {"perplexity": e["perplexity"], "nll_sum": e["nll_sum"], "tokens_scored": e["tokens_scored"],
                  "bits_per_byte": e["bits_per_byte"], "tokens_per_second": e["tokens_per_second"]}
    row["fp8_vs_bf16_perplexity_ratio"] = row["fp8"]["perplexity"] / row["bf16"]["perplexity"]
    ev[n] = row
out["perplexity"] = {
    "protocol": f"k3 eval -m models/k3-nano -f {valid} --ctx 512 --stride 512 --numerics N [--trunk-fp8] "
                "(the validation split of docs/data/k3-nano-chat-eval.json, sha256 checked)",
    "by_numerics": ev,
}
load = open(f"{tmp}/eval-{numerics[0]}-fp8.err").read().splitlines()
b = json.load(open(f"{tmp}/bench-fp8-1.json"))["settings"]["trunk_fp8_bytes"]
b0 = json.load(open(f"{tmp}/bench-bf16-1.json"))["results"][0]["model_bytes"]
b1 = json.load(open(f"{tmp}/bench-fp8-1.json"))["results"][0]["model_bytes"]
out["bytes"] = {"trunk_matrices": b["matrices"], "trunk_before": b["before"], "trunk_after": b["after"],
                "weights_held_bf16_trunk": b0, "weights_held_fp8_trunk": b1,
                "load_line": next((l for l in load if "trunk in FP8" in l), "")}
speed = {}
for t in ("bf16", "fp8"):
    per = {}
    for r in range(1, rounds + 1):
        d = json.load(open(f"{tmp}/bench-{t}-{r}.json"))
        for x in d["results"]:
            per.setdefault(x["test"], []).append(x)
    speed[t] = {}
    for test, xs in per.items():
        ts = [x["avg_ts"] for x in xs]
        e = {"median_ts": statistics.median(ts), "min_ts": min(ts), "max_ts": max(ts), "rounds_ts": ts}
        if "roofline" in xs[0]:
            e["bytes_per_token"] = xs[0]["roofline"].get("bytes_per_token")
            e["median_roofline_ratio"] = statistics.median(x["roofline"]["ratio"] for x in xs)
        speed[t][test] = e
out["speed"] = {
    "protocol": f"k3 bench -m models/k3-nano -p 128 -n 128 -r 5 [--trunk-fp8], numerics fast, 2 threads; "
                f"{rounds} alternating rounds, each round's average t/s over its 5 repetitions",
    "by_trunk": speed,
    "fp8_vs_bf16_decode_median_ratio": speed["fp8"]["tg128"]["median_ts"] / speed["bf16"]["tg128"]["median_ts"],
    "fp8_vs_bf16_prefill_median_ratio": speed["fp8"]["pp128"]["median_ts"] / speed["bf16"]["pp128"]["median_ts"],
}
print(json.dumps(out, indent=2))
PY
measure_rss
echo "wrote $out" >&2
