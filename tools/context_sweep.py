#!/usr/bin/env python3
"""Decode speed and memory against context length for several layer maps (issue 22).

Usage:
  python3 tools/context_sweep.py --k3 build-cpu/bin/k3 --model hybrid=DIR --model mla=DIR --model kda=DIR \
      --depths 1024,4096,16384 [--n 16] [-r 3] [--device cpu|cuda] --json OUT.json

For every model and depth it runs, each in a process of its own:
  * `k3 bench -m DIR -p 0 -n N -d DEPTH -r R --no-roofline --json-out ...`: decode t/s with DEPTH
    tokens already cached (the depth context is prefilled once, untimed; --depth-fill random: filled with
    seeded random values instead, no forward);
  * `k3 info -m DIR --ctx DEPTH`: the memory k3 plans for that context (weights, KDA state, MLA
    cache, buffers; on the CPU, and on the GPU).
The bench process's peak resident set (wait4's ru_maxrss; host memory only) is recorded beside the plan.
Standard library only; tools/plot_context_sweep.py draws the figure from the json.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time


SIZE = r"([\d.,]+ (?:B|KiB|MiB|GiB|TiB))"
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def size_bytes(s):
    v, u = s.split()
    return float(v.replace(",", "")) * UNITS[u]


def parse_info(text):
    """The planned sizes (bytes) from `k3 info --ctx`: the CPU line and the GPU line."""
    out = {}
    m = re.search(r"memory to run at [\d,]+ tokens.*\n\s+weights " + SIZE + r" \+ KDA state " + SIZE +
                  r" \+ MLA cache " + SIZE + r" \+ buffers ~" + SIZE + r" = " + SIZE, text)
    if m:
        out["cpu_plan"] = dict(zip(("weights", "kda_state", "mla_cache", "buffers", "total"),
                                   (size_bytes(g) for g in m.groups())))
    m = re.search(r"GPU memory to run at [\d,]+ tokens.*\n\s+weights " + SIZE + r" \+ state " + SIZE +
                  r" \+ MLA cache " + SIZE + r" \+ workspace " + SIZE + r" = " + SIZE, text)
    if m:
        out["gpu_plan"] = dict(zip(("weights", "state", "mla_cache", "workspace", "total"),
                                   (size_bytes(g) for g in m.groups())))
    return out


def run_bench(k3, model, depth, n, reps, device, depth_fill):
    """Decode timing at `depth` from one `k3 bench` process, and that process's peak RSS (bytes)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "bench.json"), os.path.join(tmp, "stderr.txt")
        cmd = [k3, "bench", "-m", model, "-p", "0", "-n", str(n), "-d", str(depth), "-r", str(reps), "--no-progress",
               "--no-roofline", "--device", device, "--depth-fill", depth_fill, "--json-out", out]
        if device == "cuda":
            cmd += ["--graphs", "on"]
        t0 = time.time()
        with open(err, "w") as ef:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=ef)
            _, status, usage = os.wait4(proc.pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        if rc != 0:
            raise SystemExit(f"context_sweep: {' '.join(cmd)} failed ({rc}): {open(err).read().strip()[-400:]}")
        doc = json.load(open(out))
    rows = [r for r in doc["results"] if r.get("n_gen", 0) > 0]
    if not rows:
        raise SystemExit(f"context_sweep: no tg result from {model} at depth {depth}")
    r = rows[0]
    return {"tg_ts": r["avg_ts"], "tg_stddev": r["stddev_ts"], "step_ms": 1e3 / r["avg_ts"],
            "peak_rss": usage.ru_maxrss * 1024, "wall_s": time.time() - t0}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k3", required=True)
    ap.add_argument("--model", action="append", required=True, help="NAME=DIR (repeat)")
    ap.add_argument("--depths", default="1024,4096,16384")
    ap.add_argument("--n", type=int, default=16, help="decode tokens per timed run")
    ap.add_argument("-r", type=int, default=3, help="timed repetitions")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--depth-fill", default="prefill", choices=["prefill", "random"],
                    help="how k3 bench makes the depth context: a prefill, or seeded random cache/state values "
                         "(no forward; what the 1M all-MLA point needs)")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    depths = [int(x) for x in a.depths.split(",")]
    models = [m.split("=", 1) for m in a.model]
    doc = {"command": " ".join(sys.argv), "device": a.device, "depth_fill": a.depth_fill, "depths": depths,
           "decode_tokens": a.n,
           "repetitions": a.r, "date": time.strftime("%Y-%m-%d"), "models": {}}
    for name, path in models:
        rows = []
        for d in depths:
            info = subprocess.run([a.k3, "info", "-m", path, "--ctx", str(d)], capture_output=True, text=True)
            if info.returncode != 0:
                raise SystemExit(f"context_sweep: k3 info failed for {path}: {info.stderr.strip()}")
            row = {"depth": d, **parse_info(info.stdout)}
            row.update(run_bench(a.k3, path, d, a.n, a.r, a.device, a.depth_fill))
            rows.append(row)
            print(f"{name:>8} depth {d:>8}: decode {row['tg_ts']:8.2f} t/s ({row['step_ms']:.3f} ms/step)"
                  + (f", peak RSS {row['peak_rss'] / 1048576:.1f} MiB" if "peak_rss" in row else "")
                  + (f", planned MLA cache {row['cpu_plan']['mla_cache'] / 1048576:.1f} MiB" if "cpu_plan" in row else ""),
                  flush=True)
            doc["models"][name] = {"path": path, "rows": rows}
            json.dump(doc, open(a.json, "w"), indent=1)  # after every point: a cut-off run keeps what it measured


if __name__ == "__main__":
    main()
