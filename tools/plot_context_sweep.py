#!/usr/bin/env python3
"""Draws the context sweep (tools/context_sweep.py json) as a PNG: decode step time and memory
against context, one line per layer map.

Usage: python3 tools/plot_context_sweep.py SWEEP.json OUT.png   (matplotlib: tools/requirements-plot.txt)
Memory is the planned per-context state (KDA state + MLA cache, `k3 info --ctx`), the part that
depends on the layer map; the measured peak RSS of each bench process is in the json.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, png):
    doc = json.load(open(src))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    plan = "gpu_plan" if doc.get("device") == "cuda" else "cpu_plan"
    for name, m in doc["models"].items():
        rows = m["rows"]
        x = [r["depth"] for r in rows]
        ax1.plot(x, [r["step_ms"] for r in rows], marker="o", label=name)
        state = [(r[plan].get("kda_state", r[plan].get("state", 0)) + r[plan]["mla_cache"]) / 2**20 for r in rows]
        ax2.plot(x, state, marker="o", label=name)
    for ax, title, unit in ((ax1, "decode step time", "ms per token"),
                            (ax2, "sequence state (KDA state + MLA cache)", "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens cached)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"k3 context sweep ({doc.get('device', 'cpu')}, {doc.get('date', '')})")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
