#!/usr/bin/env python3
"""Per-kernel GPU time per step from Nsight Compute csv files (scripts/gpu_profile.sh).

Usage: python3 tools/gpu_profile_table.py [--bench BENCH.json] [--json OUT.json] NAME=NCU.csv ...

Each csv is `ncu --csv --print-units base --metrics gpu__time_duration.sum` over one `k3 generate`:
every kernel timed alone. Steps are delimited by the argmax kernel (one per forward step). For the
decode workloads (NAME starting with "decode") the first step (the prompt's prefill) is left out and
the rest averaged; other workloads report all of their steps as one. The table per workload: kernel
(template arguments kept: they name the weight format and the row count), launches per step, us per
step, share. With --bench (a `k3 bench --json-out` document from the same call), the graph-replayed
step time of the matching tg test is printed beside the kernel sum: the difference is the time the
GPU spends between kernels.
"""
import csv
import io
import json
import re
import sys


FORMATS = {"0": "F32", "1": "F16", "2": "BF16", "3": "MXFP4"}


def short_name(name):
    """The kernel's own name with its template arguments: namespaces, return type and parameter
    list dropped (ncu prints either the demangled signature or the bare function name). The
    GEMV kernels' first template argument is the weight format (k3::WFormat), shown by name."""
    name = name.replace("(anonymous namespace)", "anon").replace("<unnamed>", "anon")
    name = re.sub(r"\(k3::WFormat\)([0-3])", lambda g: FORMATS[g.group(1)], name)
    m = re.search(r"([A-Za-z_]\w*)\s*(<[^()]*>)?\s*\(", name)
    if not m:
        m = re.search(r"([A-Za-z_]\w*)\s*(<[^()]*>)?\s*$", name)
    if not m:
        return name
    base, targs = m.group(1), m.group(2) or ""
    if re.search(r"(gemv|expert|gemm_simt).*", base) and targs:
        targs = re.sub(r"^<([0-3])\b", lambda g: "<" + FORMATS[g.group(1)], targs)
    return base + targs


def read_ncu(path):
    text = open(path, errors="replace").read()
    at = text.find('"ID","Process ID"')
    if at < 0:
        raise SystemExit(f"{path}: no ncu csv header (did ncu run?)")
    rows = []
    for r in csv.DictReader(io.StringIO(text[at:])):
        if r.get("Metric Name") != "gpu__time_duration.sum" or not r.get("Kernel Name"):
            continue
        try:
            rows.append((short_name(r["Kernel Name"]), float(r["Metric Value"].replace(",", "")) * 1e-3))  # ns -> us
        except ValueError:
            continue
    return rows


def steps_of(rows):
    steps, cur = [], []
    for name, us in rows:
        cur.append((name, us))
        if name.startswith("argmax_kernel"):
            steps.append(cur)
            cur = []
    if cur:
        steps.append(cur)
    return steps


def table(name, rows, bench_ms):
    steps = steps_of(rows)
    use = steps[1:] if name.startswith("decode") and len(steps) > 1 else [sum(steps, [])]
    n = len(use)
    agg = {}
    for st in use:
        for k, us in st:
            c, t = agg.get(k, (0, 0.0))
            agg[k] = (c + 1, t + us)
    total = sum(t for _, t in agg.values()) / n
    items = sorted(agg.items(), key=lambda kv: -kv[1][1])
    lines = [f"\n### {name}: {n} step(s) averaged, {sum(c for c, _ in agg.values()) / n:.0f} kernels per step, "
             f"{total:.1f} us of kernel time per step"]
    if bench_ms:
        lines.append(f"graph-replayed step (k3 bench, same call): {bench_ms * 1e3:.1f} us; kernel sum / step = "
                     f"{total / (bench_ms * 1e3):.1%}")
    lines += ["", "| kernel | launches/step | us/step | share |", "| --- | ---: | ---: | ---: |"]
    for k, (c, t) in items:
        lines.append(f"| `{k}` | {c / n:.1f} | {t / n:.1f} | {t / n / total:.1%} |")
    doc = {"steps": n, "kernel_us_per_step": total, "bench_step_us": bench_ms * 1e3 if bench_ms else None,
           "kernels": [{"kernel": k, "launches_per_step": c / n, "us_per_step": t / n} for k, (c, t) in items]}
    return "\n".join(lines), doc


def bench_step_ms(bench, name):
    if not bench:
        return None
    batch = 32 if name == "decode32" else 1
    for r in bench.get("results", []):
        if name.startswith("decode") and r.get("test", "").startswith("tg") and "no-graphs" not in r["test"] \
                and r.get("n_batch", 1) == batch:
            return 1e3 / r["per_seq_ts"]
        if name.startswith("prefill") and r.get("test", "").startswith("pp") and r.get("n_batch", 1) == 1:
            return 1e3 * r["n_prompt"] / r["avg_ts"]
    return None


def main(argv):
    bench, out_json, work = None, None, []
    i = 1
    while i < len(argv):
        if argv[i] == "--bench":
            try:
                bench = json.load(open(argv[i + 1]))
            except (OSError, ValueError) as e:
                print(f"(bench json not read: {e})")
            i += 2
        elif argv[i] == "--json":
            out_json = argv[i + 1]
            i += 2
        else:
            name, _, path = argv[i].partition("=")
            work.append((name, path))
            i += 1
    docs = {}
    for name, path in work:
        try:
            rows = read_ncu(path)
        except (OSError, SystemExit) as e:
            print(f"\n### {name}: {e}")
            continue
        md, doc = table(name, rows, bench_step_ms(bench, name))
        print(md)
        docs[name] = doc
    if out_json:
        json.dump(docs, open(out_json, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv)
