#!/usr/bin/env python3
"""Derive a `k3 plan` calibration for "1xH200 (from the recorded runs)" from the GPU records in
docs/data/, naming the file and field behind every rate (the file's "sources" map).

Owns: the arithmetic from recorded true-width K3 layer times to the planner's GPU rates.
Must not: invent a rate that no record supports: the CPU and disk parts and the PCIe rate are left
out (null): no record of the H200 machine's CPU at K3 width, its disk or its PCIe link exists, so
`k3 plan` takes them nominally and says so.

Usage: python3 tools/plan/calibration_from_records.py [--k3 build/bin/k3] [--out FILE]
(the k3 binary prints the parameter counts of tests/fixtures/k3-config-only with `k3 info`: the
engine's own size functions, not a second count here).
"""
import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYER_GPU = "docs/data/k3-layer-bench-gpu.json"


def load(rel):
    with open(os.path.join(ROOT, rel)) as f:
        return json.load(f)


def info_counts(k3, config_dir):
    """Parameter counts from `k3 info` (arch_stats): {label: int}."""
    out = subprocess.run([k3, "info", "-m", os.path.join(ROOT, config_dir)], check=True, capture_output=True,
                         text=True).stdout
    counts = {}
    for label in ("KDA attention block", "MLA attention block", "MoE block excl. routed", "one routed expert"):
        m = re.search(r"^\s+" + re.escape(label) + r"\s+([\d,]+)", out, re.M)
        if not m:
            sys.exit(f"calibration_from_records: `k3 info` printed no '{label}' line")
        counts[label] = int(m.group(1).replace(",", ""))
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k3", default=os.path.join(ROOT, "build", "bin", "k3"), help="the k3 binary (for k3 info)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "data", "calibration-h200-recorded.json"))
    a = ap.parse_args()

    rec = load(LAYER_GPU)
    if rec.get("device") != "cuda" or "H200" not in rec.get("gpu", ""):
        sys.exit(f"calibration_from_records: {LAYER_GPU} is not an H200 record (gpu: {rec.get('gpu')})")
    config_dir = rec["config"]  # the true-width K3 config the layers were built from
    cfg = load(os.path.join(config_dir, "config.json"))
    text = cfg.get("text_config", cfg)
    hidden, vocab, top_k = text["hidden_size"], text["vocab_size"], text["num_experts_per_token"]
    c = info_counts(a.k3, config_dir)
    n_kda, n_mla = rec["layers"]["kda"], rec["layers"]["mla"]
    ex = rec["extrapolated"]
    sources = {}

    # Decode, batch 1: every byte the extrapolated step reads (69 KDA + 24 MLA layers with top-16
    # experts and the MLA cache at decode_depth, + lm_head) over the step's time. One rate for the
    # trunk and the experts: the record does not time them apart.
    decode_bps = ex["decode_bytes_per_token"] / ex["decode_s_per_token"]
    what = (f"{LAYER_GPU}: extrapolated.decode_bytes_per_token / extrapolated.decode_s_per_token "
            f"({ex['decode_bytes_per_token']} B / {ex['decode_s_per_token']:.6f} s; trunk and experts together)")
    sources["gpu.trunk_gemv_Bps"] = what
    sources["gpu.expert_gemv_Bps"] = what

    # Batched decode compute: the lm_head at 32 rows (no experts, no state: weights x rows only).
    b32 = next(r for r in rec["decode_by_batch"] if r["batch"] == 32)
    decode_flops = 2.0 * vocab * hidden * 32 / (b32["lm_head_ms"] * 1e-3)
    sources["gpu.decode_flops"] = (f"{LAYER_GPU}: 2 x vocab {vocab} x hidden {hidden} x 32 rows / "
                                   f"decode_by_batch[batch 32].lm_head_ms ({b32['lm_head_ms']:.4f} ms)")

    # Prefill: the weight FLOPs of one token through the extrapolated layers (what prefill_s_per_token
    # covers: no lm_head) over its time. Attention is inside the time, so this is an effective rate.
    per_layer_moe = c["MoE block excl. routed"] + top_k * c["one routed expert"]
    flops = 2.0 * (n_kda * (c["KDA attention block"] + per_layer_moe) + n_mla * (c["MLA attention block"] + per_layer_moe))
    gemm = flops / ex["prefill_s_per_token"]
    what = (f"{LAYER_GPU}: 2 x weights of {n_kda} KDA + {n_mla} MLA MoE layers with top-{top_k} experts "
            f"({flops:.4g} FLOP, counts from `k3 info -m {config_dir}`) / extrapolated.prefill_s_per_token "
            f"({ex['prefill_s_per_token']:.6f} s, prefill_tokens {rec['prefill_tokens']}); effective: MLA/KDA "
            f"attention time included")
    sources["gpu.gemm_flops"] = what
    sources["gpu.expert_gemm_flops"] = what
    sources["gpu.layer_s"] = ("0: included in gpu.trunk_gemv_Bps (the decode rate is whole layers' "
                              "time, their norms, router and attention too)")
    sources["gpu.hbm_copy_Bps"] = f"{LAYER_GPU}: roofline.read_gbs (cuda::measure_copy_gbs in the same run)"

    out = {
        "k3_calibration": 1,
        "label": "1xH200 (from the recorded runs)",
        "date": "",
        "command": "python3 tools/plan/calibration_from_records.py",
        "machine": f"{rec['gpu']} (records: {LAYER_GPU}); CPU, disk and PCIe not recorded: nominal in k3 plan",
        "cpu": None,
        "disk": None,
        "gpu": {
            "name": rec["gpu"],
            "table_name": "H200",
            "hbm_bytes": None,
            "hbm_copy_Bps": rec["roofline"]["read_gbs"] * 1e9,
            "trunk_gemv_Bps": decode_bps,
            "expert_gemv_Bps": decode_bps,
            "decode_flops": decode_flops,
            "gemm_flops": gemm,
            "expert_gemm_flops": gemm,
            "pcie_h2d_Bps": None,
            "pcie_d2h_Bps": None,
            # the rates above are whole decode steps (every per-layer op included): no term of its own
            "layer_s": 0.0,
        },
        "sources": sources,
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print(f"wrote {os.path.relpath(a.out, ROOT)}: decode {decode_bps / 1e12:.3f} TB/s, batched decode "
          f"{decode_flops / 1e12:.1f} TFLOP/s, prefill {gemm / 1e12:.1f} TFLOP/s effective")


if __name__ == "__main__":
    main()
