#!/usr/bin/env python3
"""One long prefill, then decode from it, with the memory it took against what k3 plans (issue 22).

Usage:
  python3 tools/long_prefill.py --k3 build/bin/k3 --model DIR --tokens 131072 [--decode 64] [--ubatch 2048]
      [--device cpu|cuda] [--numerics fast] [--mla auto] [--extra "ARGS"] --json OUT.json

Runs, each in a process of its own:
  * `k3 info -m DIR --ctx TOKENS+DECODE --ubatch U`: the memory k3 plans for one sequence at that
    context (CPU line, and the GPU line);
  * `k3 bench -m DIR -p 0 -n DECODE -d TOKENS -r 1 --ubatch U --depth-fill prefill`: the depth context is
    a real prefill of TOKENS seeded random ids in U-token steps (its wall time is recorded:
    depth_prefills), then DECODE greedy steps from it (a warm-up run and one timed run, each starting
    from a copy of the prefilled context).
Recorded: prefill wall time and t/s, decode t/s at that depth, the bench process's peak resident set
(wait4's ru_maxrss: host memory) and, on the GPU, the device memory in use at its end, each against
k3 info's plan for one sequence (k3 bench's timed run decodes into a fork of the prefilled context,
whose cache pages are shared copy-on-write, so it holds one sequence's cache plus a page or two).
Standard library only.
"""
import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from context_sweep import parse_info  # noqa: E402  (the same reading of `k3 info --ctx`)


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit():
    r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return r.stdout.strip() if r.returncode == 0 else "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k3", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, required=True, help="prefill length")
    ap.add_argument("--decode", type=int, default=64, help="greedy decode steps after the prefill")
    ap.add_argument("--ubatch", type=int, default=2048, help="prefill tokens per step")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--numerics", default="fast", choices=["fast", "fp32", "exact"])
    ap.add_argument("--mla", default="auto", choices=["auto", "absorbed", "expanded"])
    ap.add_argument("--extra", default="", help="more k3 bench flags (e.g. \"-t 16\")")
    ap.add_argument("--json", required=True)
    ap.add_argument("--log", help="also copy k3 bench's stderr (its progress) to this file as it runs")
    ap.add_argument("--replan", action="store_true",
                    help="do not run the bench: read the record --json, plan its context again with this k3 info "
                         "(after a change to the plan) and add that plan, its ratio and commit as replanned")
    a = ap.parse_args()
    if a.tokens < 1 or a.decode < 1 or a.ubatch < 1:
        ap.error("--tokens, --decode and --ubatch must be >= 1")
    ctx = a.tokens + a.decode
    info = subprocess.run([a.k3, "info", "-m", a.model, "--ctx", str(ctx), "--ubatch", str(a.ubatch)],
                          capture_output=True, text=True)
    if info.returncode != 0:
        raise SystemExit(f"long_prefill: k3 info failed for {a.model}: {info.stderr.strip()}")
    plan = parse_info(info.stdout)
    if "cpu_plan" not in plan:
        raise SystemExit("long_prefill: could not read the memory plan from `k3 info --ctx`:\n" + info.stdout)
    if a.replan:
        rec = json.load(open(a.json))
        if rec["prefill_tokens"] != a.tokens or rec["decode_tokens"] != a.decode:
            raise SystemExit("long_prefill: --replan: --tokens/--decode differ from the record's")
        rec["replanned"] = {"command": " ".join(shlex.quote(x) for x in sys.argv), "planned": plan,
                            "peak_rss_vs_cpu_plan": rec["peak_rss_bytes"] / plan["cpu_plan"]["total"],
                            "commit": git_commit(), "date": datetime.date.today().isoformat()}
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1)
            f.write("\n")
        print(f"long_prefill: replanned {a.json}: peak RSS {rec['peak_rss_bytes'] / 2**30:.2f} GiB vs planned "
              f"{plan['cpu_plan']['total'] / 2**30:.2f} GiB ({rec['replanned']['peak_rss_vs_cpu_plan']:.3f}x)")
        return

    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "bench.json"), os.path.join(tmp, "stderr.txt")
        cmd = [a.k3, "bench", "-m", a.model, "-p", "0", "-n", str(a.decode), "-d", str(a.tokens), "-r", "1",
               "--ubatch", str(a.ubatch), "--depth-fill", "prefill", "--numerics", a.numerics, "--mla", a.mla,
               "--device", a.device, "--no-roofline", "--json-out", out] + shlex.split(a.extra)
        print("long_prefill: " + " ".join(cmd), flush=True)
        t0 = time.time()
        # On the GPU: the device memory in use, sampled by nvidia-smi every 200 ms while the bench runs
        # (its peak, and what was in use before it started).
        smi_out = os.path.join(tmp, "smi.csv")
        smi = None
        gpu_before = None
        if a.device == "cuda":
            q = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"]
            try:
                gpu_before = int(subprocess.run(q, capture_output=True, text=True).stdout.split()[0]) * 2**20
                smi = subprocess.Popen(q + ["-lms", "200"], stdout=open(smi_out, "w"), stderr=subprocess.DEVNULL)
            except (OSError, ValueError, IndexError):
                smi = None
        with open(err, "w") as ef:
            log = open(a.log, "w") if a.log else None
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            for chunk in iter(lambda: proc.stderr.read1(4096), b""):
                ef.write(chunk.decode(errors="replace"))
                if log:
                    log.write(chunk.decode(errors="replace"))
                    log.flush()
            _, status, usage = os.wait4(proc.pid, 0)
            if log:
                log.close()
        wall = time.time() - t0
        gpu_peak = None
        if smi is not None:
            smi.terminate()
            smi.wait()
            vals = [int(x) for x in open(smi_out).read().split() if x.isdigit()]
            gpu_peak = max(vals) * 2**20 if vals else None
        rc = os.waitstatus_to_exitcode(status)
        if rc != 0:
            raise SystemExit(f"long_prefill: k3 bench failed ({rc}): {open(err).read().strip()[-600:]}")
        doc = json.load(open(out))
    pre = [p for p in doc.get("depth_prefills", []) if p["n_depth"] == a.tokens]
    tg = [r for r in doc["results"] if r.get("n_gen", 0) > 0]
    if not pre or not tg:
        raise SystemExit("long_prefill: the bench json lacks the depth prefill or the decode result")
    pre, tg = pre[0], tg[0]
    peak_rss = usage.ru_maxrss * 1024
    cpu_total = plan["cpu_plan"]["total"]
    res = {
        "what": f"{a.tokens}-token prefill (seeded random ids, {a.ubatch}-token steps), then {a.decode} greedy "
                "decode steps from it; memory against `k3 info --ctx` (issue 22)",
        "command": " ".join(shlex.quote(x) for x in sys.argv),
        "bench_command": " ".join(shlex.quote(x) for x in cmd),
        "model": os.path.basename(os.path.normpath(a.model)),
        "device": a.device,
        "numerics": a.numerics,
        "mla": a.mla,
        "prefill_tokens": a.tokens,
        "prefill_s": pre["seconds"],
        "prefill_ts": pre["ts"],
        "decode_tokens": a.decode,
        "decode_ts": tg["avg_ts"],
        "decode_ms_per_token": 1e3 / tg["avg_ts"],
        "bench_wall_s": wall,
        "peak_rss_bytes": peak_rss,
        "planned": plan,
        "peak_rss_vs_cpu_plan": peak_rss / cpu_total,
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count()},
        "build": doc.get("build", {}),
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
    }
    if gpu_peak is not None:
        res["gpu_peak_used_bytes_nvidia_smi"] = gpu_peak
        res["gpu_used_bytes_before_nvidia_smi"] = gpu_before
        if "gpu_plan" in plan:
            res["gpu_peak_vs_gpu_plan"] = (gpu_peak - (gpu_before or 0)) / plan["gpu_plan"]["total"]
    if "gpu_engine_peak_bytes" in doc:
        # What the engine itself allocated at its peak (the plan's subject), and what the CUDA runtime
        # added on top (context, libraries: nvidia-smi's peak minus that, minus what was in use before).
        res["gpu_engine_peak_bytes"] = doc["gpu_engine_peak_bytes"]
        if "gpu_engine_peak_by_buffer" in doc:  # what the peak was made of, by buffer
            res["gpu_engine_peak_by_buffer"] = doc["gpu_engine_peak_by_buffer"]
        if "gpu_plan" in plan:
            res["gpu_engine_peak_vs_gpu_plan"] = doc["gpu_engine_peak_bytes"] / plan["gpu_plan"]["total"]
        if gpu_peak is not None:
            res["gpu_runtime_overhead_bytes"] = gpu_peak - (gpu_before or 0) - doc["gpu_engine_peak_bytes"]
    if "gpu_used_bytes_at_end" in doc:
        res["gpu_used_bytes_at_end"] = doc["gpu_used_bytes_at_end"]
        if "gpu_plan" in plan:
            res["gpu_used_vs_gpu_plan"] = doc["gpu_used_bytes_at_end"] / plan["gpu_plan"]["total"]
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    print(f"long_prefill: {a.tokens} tokens prefilled in {pre['seconds']:.1f} s ({pre['ts']:.2f} t/s), decode "
          f"{tg['avg_ts']:.2f} t/s at that depth; peak RSS {peak_rss / 2**30:.2f} GiB vs planned "
          f"{cpu_total / 2**30:.2f} GiB ({peak_rss / cpu_total:.3f}x); wrote {a.json}")
    if "gpu_engine_peak_vs_gpu_plan" in res:
        print(f"long_prefill: GPU: the engine's allocations peaked at {res['gpu_engine_peak_bytes'] / 2**30:.2f} GiB, "
              f"{res['gpu_engine_peak_vs_gpu_plan']:.3f}x k3 info's plan of {plan['gpu_plan']['total'] / 2**30:.2f} GiB; "
              f"nvidia-smi peak {(gpu_peak or 0) / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
