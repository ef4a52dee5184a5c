#!/usr/bin/env python3
"""Issue 20's measurements on a GPU machine: the hybrid placement's overlap, the hot-expert cache,
and k3 plan's prediction against three forced placements.

Usage (on the GPU machine; scripts/measure_hybrid.sh runs it):
  python3 tools/hybrid_check.py --k3 K3 --model DIR [--depth 512] [--gen 64] [--threads N] --json OUT.json

Runs, each in a process of its own:
  * `k3 plan --calibrate`: this machine's rates (GPU GEMV/GEMM, CPU expert GEMV, PCIe, disk);
  * `k3 plan -m DIR --calibration FILE --placement P --json` for P in gpu, hybrid, cpu: the predicted
    decode t/s of one sequence at DEPTH + GEN tokens;
  * `k3 bench -p 0 -n GEN -d DEPTH -r 3 --profile`: measured decode t/s and, from the profiled run, the
    time of every backend op, for
      gpu     --device cuda (all weights on the GPU),
      hybrid  --device cuda --cpu-experts (routed experts in host RAM, computed by the CPU in fp32
              activations, the default),
      hybrid_q8   the same with --cpu-experts-q8 (8-bit activations, as a CPU-only run),
      hot25 / hot50   the same with --hot-experts 0.25 / 0.5 (the GPU's cache of hot experts),
      cpu     --device cpu -t THREADS.
Derived: the GPU trunk time per step (the gpu run's profiled step less its routed experts), the CPU
expert time per step (the hybrid run's moe_routed op), and the acceptance ratios: hybrid step /
max(trunk, CPU experts) (goal <= 1.15), each placement's measured / predicted t/s (goal within 20%),
the hot caches' hit rates and speed-up over the uncached hybrid. Standard library only.
"""
import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile


def run(cmd, what):
    print("hybrid_check: " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"hybrid_check: {what} failed ({r.returncode}): {r.stderr.strip()[-800:]}")
    return r.stdout


def bench(a, tmp, name, extra):
    out = os.path.join(tmp, name + ".json")
    cmd = [a.k3, "bench", "-m", a.model, "-p", "0", "-n", str(a.gen), "-d", str(a.depth), "-r", "3", "--profile",
           "--no-progress", "--no-roofline", "--json-out", out] + extra
    run(cmd, "k3 bench (" + name + ")")
    doc = json.load(open(out))
    tg = [r for r in doc["results"] if r.get("n_gen", 0) > 0]
    if not tg:
        raise SystemExit(f"hybrid_check: no decode result in the {name} bench")
    # With graphs on and off the bench reports two decode rows on CUDA: the faster is the engine's default.
    best = max(tg, key=lambda r: r["avg_ts"])
    prof = next((r["profile"] for r in tg if "profile" in r), None)
    res = {"command": " ".join(shlex.quote(c) for c in cmd), "decode_ts": best["avg_ts"],
           "step_ms": 1e3 / best["avg_ts"]}
    if prof and prof["steps"] > 0:
        ops = {o["op"]: o["ms"] / prof["steps"] for o in prof["ops"]}
        res["profile_ms_per_step"] = ops
        res["profile_step_ms"] = prof["op_ms_total"] / prof["steps"]
    if "expert_cache" in doc:  # k3 bench's record of the GPU's hot-expert cache
        res["hot_experts"] = doc["expert_cache"]
    return res


def plan(a, cal, placement, extra=()):
    out = run([a.k3, "plan", "-m", a.model, "--calibration", cal, "--placement", placement, "--ctx",
               str(a.depth + a.gen), "--batch", "1", "--json"] + list(extra),
              "k3 plan --placement " + " ".join([placement] + list(extra)))
    p = json.loads(out)["plan"]
    return {"kind": p["kind"], "fits": p["fits"], "why_not": p.get("why_not", ""),
            "decode_ts": p["decode_batch1"]["tokens_per_s"], "decode_terms": p["decode_batch1"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k3", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--depth", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    res = {"what": "issue 20 on one GPU machine: hybrid overlap, hot-expert cache, k3 plan vs measured",
           "command": " ".join(shlex.quote(x) for x in sys.argv), "model": os.path.basename(os.path.normpath(a.model)),
           "depth": a.depth, "gen": a.gen, "threads": a.threads, "date": datetime.date.today().isoformat()}
    with tempfile.TemporaryDirectory() as tmp:
        cal = os.path.join(tmp, "calibration.json")
        run([a.k3, "plan", "--calibrate", "--out", cal], "k3 plan --calibrate")
        res["calibration"] = json.load(open(cal))
        # Each placement as the bench below runs it: the hybrid runs with no GPU cache (--cpu-experts
        # alone) and with a quarter and a half of the experts cached (--hot-experts).
        res["predicted"] = {"gpu": plan(a, cal, "gpu"), "hybrid": plan(a, cal, "hybrid", ["--hot-experts", "0"]),
                            "hot25": plan(a, cal, "hybrid", ["--hot-experts", "0.25"]),
                            "hot50": plan(a, cal, "hybrid", ["--hot-experts", "0.5"]),
                            "hybrid_q8": plan(a, cal, "hybrid", ["--hot-experts", "0", "--cpu-experts-q8"]),
                            "cpu": plan(a, cal, "cpu")}
        gpu = ["--device", "cuda"]
        # The CPU computes the routed experts of the hybrid runs: all the threads the CPU run gets.
        hyb = gpu + ["--cpu-experts", "-t", str(a.threads)]
        res["measured"] = {
            "gpu": bench(a, tmp, "gpu", gpu),
            "hybrid": bench(a, tmp, "hybrid", hyb),
            "hot25": bench(a, tmp, "hot25", hyb + ["--hot-experts", "0.25"]),
            "hot50": bench(a, tmp, "hot50", hyb + ["--hot-experts", "0.5"]),
            "hybrid_q8": bench(a, tmp, "hybrid_q8", hyb + ["--cpu-experts-q8"]),
            "cpu": bench(a, tmp, "cpu", ["--device", "cpu", "-t", str(a.threads)]),
        }
    m = res["measured"]
    derived = {}
    g, h = m["gpu"].get("profile_ms_per_step"), m["hybrid"].get("profile_ms_per_step")
    if g and h:
        trunk = m["gpu"]["profile_step_ms"] - g.get("moe_routed", 0.0)
        cpu_experts = h.get("moe_routed", 0.0)
        derived["gpu_trunk_ms"] = trunk
        derived["cpu_experts_ms"] = cpu_experts
        derived["hybrid_step_ms"] = m["hybrid"]["step_ms"]
        derived["hybrid_vs_max"] = m["hybrid"]["step_ms"] / max(trunk, cpu_experts)
        derived["hybrid_vs_max_goal"] = 1.15
        q = m["hybrid_q8"].get("profile_ms_per_step")
        if q:
            derived["cpu_experts_q8_ms"] = q.get("moe_routed", 0.0)
            derived["hybrid_q8_vs_max"] = m["hybrid_q8"]["step_ms"] / max(trunk, q.get("moe_routed", 0.0))
    for name, key in (("gpu", "gpu"), ("hybrid", "hybrid"), ("hot25", "hot25"), ("hot50", "hot50"),
                      ("hybrid_q8", "hybrid_q8"), ("cpu", "cpu")):
        if key not in res["predicted"]:
            continue
        pred = res["predicted"][key]["decode_ts"]
        derived[f"{name}_measured_vs_predicted"] = m[name]["decode_ts"] / pred if pred > 0 else None
    for hot in ("hot25", "hot50"):
        he = m[hot].get("hot_experts", {})
        derived[f"{hot}_hit_rate"] = he.get("hit_rate")
        derived[f"{hot}_speedup_vs_hybrid"] = m[hot]["decode_ts"] / m["hybrid"]["decode_ts"]
    res["derived"] = derived
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    print(json.dumps(derived, indent=1))


if __name__ == "__main__":
    main()
