#!/usr/bin/env python3
"""Summarise the `k3 plan --json` records of scripts/plan_full_k3.sh (docs/data/plan-*.json) into
docs/data/plan-summary.md, and check the planner against the recorded true-width layer bench
(docs/data/k3-layer-bench-gpu.json) into docs/data/plan-check-layer-bench.json.

Owns: reading those files and tabulating their fields. Must not: compute a prediction of its own
(every number is a field of a plan record or of the layer-bench record, or a ratio of two).
Usage: python3 tools/plan/plan_summary.py  (plain python3, stdlib only)
"""
import glob
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "docs", "data")
CASES = [
    ("a-h200-ddr5", "(a) 1 x H200 + 2-socket DDR5 server"),
    ("a-h200-ddr5-q8", "(a) with --cpu-experts-q8 (8-bit activations for the CPU's experts)"),
    ("b-h100-fp8", "(b) 1 x H100 80 GB, FP8 trunk"),
    ("b-h100-fp8-batch32", "(b) at batch 32 (the state does not fit the GPU)"),
    ("c-cpu-1.5tib", "(c) CPU only, 1.5 TiB RAM"),
    ("c-cpu-1.5e12", "(c') CPU only, 1.5e12 B RAM"),
    ("c-cpu-xeon-amx", "(c-amx) CPU only, 2-socket Xeon with AMX, 1.5 TiB"),
    ("tp16-ep16-2x8h200", "2 x 8 H200, TP16 / EP16"),
    ("hybrid-1x8h200", "1 x 8 H200, hybrid (planner's choice)"),
]


def load(name):
    with open(os.path.join(DATA, name)) as f:
        return json.load(f)


def ms(s):
    return f"{s * 1e3:.1f}"


def main():
    rows = []
    detail = []
    for key, title in CASES:
        path = f"plan-{key}.json"
        if not os.path.exists(os.path.join(DATA, path)):
            raise SystemExit(f"plan_summary: {path} is missing (run scripts/plan_full_k3.sh)")
        j = load(path)
        p = j["plan"]
        d1, dB, f = p["decode_batch1"], p["decode_batch"], p["prefill"]
        kind = p["kind"] + (f" TP{p['tp']} EP{p['ep']}" if p["gpus"] > 1 else "")
        rows.append(f"| {title} | {kind} | {d1['tokens_per_s']:.2f} | {dB['tokens_per_s']:.1f} ({dB['batch']}) | "
                    f"{f['tokens_per_s']:.0f} | `{path}` |")
        detail.append(f"- **{title}** (`{path}`): rates {j['rates']['mode']}; routed experts on GPUs "
                      f"{100 * p['routed_experts']['on_gpus']:.2f}%, in RAM {100 * p['routed_experts']['in_ram']:.2f}%, "
                      f"on disk {100 * p['routed_experts']['on_disk']:.2f}%; decode batch 1 step {ms(d1['step_s'])} ms "
                      f"= GPU total {ms(d1['gpu_total_s'])} ms (trunk {ms(d1['gpu_trunk_s'])}, shared part "
                      f"{ms(d1['gpu_shared_s'])}, experts {ms(d1['gpu_experts_s'])}, collectives "
                      f"{ms(d1['collectives_s'])}), CPU total {ms(d1['cpu_total_s'])} ms (experts "
                      f"{ms(d1['cpu_experts_s'])}, disk {ms(d1['disk_s'])}), PCIe {ms(d1['pcie_s'])} ms, sync "
                      f"{ms(d1['sync_s'])} ms; ideal overlap bound {ms(d1['ideal_overlap_s'])} ms "
                      f"({1 / d1['ideal_overlap_s']:.1f} t/s); batch {dB['batch']}: {dB['how']}; prefill: {f['choice']}")
    md = ["# k3 plan on the released K3 config (predictions)", "",
          "Written by `python3 tools/plan/plan_summary.py` from the `k3 plan --json` records of "
          "`bash scripts/plan_full_k3.sh` (context 4096, prompt 4096). Predicted, not measured.", "",
          "| case | placement | decode t/s, batch 1 | decode t/s aggregate (batch) | prefill t/s (4096) | record |",
          "| --- | --- | ---: | ---: | ---: | --- |"] + rows + [""] + detail + [""]

    # Check: the planner's all-on-one-H200 prediction (the 'gpu' placement of case (a), which does
    # not fit but is evaluated) against the layer bench it was calibrated from.
    a = load("plan-a-h200-ddr5.json")
    g = next(c for c in a["considered"] if c["kind"] == "gpu")
    rec = load("k3-layer-bench-gpu.json")
    b32 = next(r for r in rec["decode_by_batch"] if r["batch"] == 32)
    check = {
        "what": "k3 plan's all-on-GPU prediction for one H200 with every weight resident (hypothetical: it does not "
                "fit) beside the true-width layer-bench extrapolation its calibration came from",
        "plan_record": "docs/data/plan-a-h200-ddr5.json considered[kind gpu]",
        "bench_record": "docs/data/k3-layer-bench-gpu.json",
        "decode_batch1": {"planned_s": g["decode_batch1"]["step_s"], "recorded_s": rec["extrapolated"]["decode_s_per_token"]},
        "decode_batch32": {"planned_s": g["decode_batch"]["step_s"], "recorded_s": b32["step_s"]},
        "prefill_per_token": {"planned_s": g["prefill"]["seconds"] / g["prefill"]["prompt"],
                              "recorded_s": rec["extrapolated"]["prefill_s_per_token"]},
    }
    for k in ("decode_batch1", "decode_batch32", "prefill_per_token"):
        check[k]["planned_over_recorded"] = check[k]["planned_s"] / check[k]["recorded_s"]
    with open(os.path.join(DATA, "plan-check-layer-bench.json"), "w") as f:
        json.dump(check, f, indent=2)
        f.write("\n")
    md += ["## Check against the recorded layer bench", "",
           "The planner's all-on-one-H200 prediction (every weight resident: hypothetical) beside the true-width "
           "layer bench its calibration came from (`docs/data/plan-check-layer-bench.json`):", "",
           "| | planned | recorded | planned / recorded |", "| --- | ---: | ---: | ---: |"]
    for k, label in (("decode_batch1", "decode step, batch 1"), ("decode_batch32", "decode step, batch 32"),
                     ("prefill_per_token", "prefill per token (4096)")):
        c = check[k]
        md.append(f"| {label} | {c['planned_s'] * 1e3:.2f} ms | {c['recorded_s'] * 1e3:.2f} ms | "
                  f"{c['planned_over_recorded']:.3f} |")
    md.append("")
    with open(os.path.join(DATA, "plan-summary.md"), "w") as f:
        f.write("\n".join(md))
    print("wrote docs/data/plan-summary.md and docs/data/plan-check-layer-bench.json")


if __name__ == "__main__":
    main()
