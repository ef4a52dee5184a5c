#!/usr/bin/env python3
"""Merge several `k3 bench --json-out` documents of one device run into one docs/data record.

Usage: python3 tools/records/merge_bench.py --out FILE --command CMD --machine TEXT [--note TEXT]
           NAME=BENCH.json [NAME=BENCH.json ...]
Each input keeps its settings and results (test, avg_ts, stddev_ts, roofline ratio) under its NAME;
the build block of the first input is kept once. Standard library only.
"""
import argparse
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--machine", required=True)
    ap.add_argument("--date", required=True)
    ap.add_argument("--note", default="")
    ap.add_argument("inputs", nargs="+")
    a = ap.parse_args()
    rec = {"command": a.command, "machine": a.machine, "date": a.date}
    if a.note:
        rec["note"] = a.note
    runs = {}
    for item in a.inputs:
        name, path = item.split("=", 1)
        d = json.load(open(path))
        rec.setdefault("build", d.get("build"))
        runs[name] = {
            "settings": d.get("settings"),
            "results": [{k: r.get(k) for k in ("test", "n_batch", "avg_ts", "stddev_ts", "samples_ns", "model_bytes")}
                        | ({"roofline_ratio": r["roofline"].get("ratio")} if r.get("roofline") else {})
                        for r in d.get("results", [])],
            "gpu_engine_peak_bytes": d.get("gpu_engine_peak_bytes"),
        }
    rec["runs"] = runs
    with open(a.out, "w") as f:
        json.dump(rec, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
