#!/usr/bin/env python3
"""KDA kernels beside their peers (issue 19, goal 4): merges and tabulates scripts/measure_kda_peers.sh's output.

Usage:
  python3 tools/kda_peer_table.py merge OURS.json PEERS.json -o kda-peers-gpu.json
      OURS = `k3_kda_gpu_bench` stdout, PEERS = `tools/peer/kda_peers.py --out` file, both from one
      device call. Writes one row per (case, gate) with our variants, the peers' timings and ratios.
  python3 tools/kda_peer_table.py table kda-peers-gpu.json [-o docs/data/kda-peers-gpu.md]
      The markdown for docs/data (stdout without -o).

Ratios (ours / peer; above 1 means ours is slower):
  ratio_ours_over_best_peer  ours prep+kda (raw q, k, f, beta logits -> o: l2norm, gate, sigmoid, then the
                             KDA kernel) over the fastest peer doing the same in its fused call
                             (FlashKDA always; fla with its *_in_kernel flags): the like-for-like scope.
  ratio_kda_over_fla_kernel  our KDA kernel alone over fla on the same prepared inputs.
"""
import argparse
import json
import sys

PEER_COLS = [("flashkda.fused", "FlashKDA"), ("fla.fused", "fla fused"), ("fla.kernel", "fla kernel")]


def ms(d, key):
    v = (d or {}).get(key)
    return v.get("ms_median") if isinstance(v, dict) else None


def ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def merge(ours, peers):
    by_key = {(c["name"], c["gate"]): c for c in peers.get("cases", [])}
    rows = []
    for c in ours.get("cases", []):
        p = by_key.get((c["name"], c["gate"]), {})
        pv = p.get("peers", {})
        fused = {k: v["ms_median"] for k, v in pv.items() if k.endswith(".fused")}
        best = min(fused, key=fused.get) if fused else None
        v = c.get("variants", {})
        row = {k: c.get(k) for k in ("name", "kind", "gate", "T", "H", "D", "seqs", "rows", "mean_chunk_len_est",
                                     "state_bytes_read_written")}
        row["ours"] = v
        row["peers"] = pv
        row["peer_errors"] = p.get("errors", {}) if p else {"all": "no peer result for this case"}
        row["best_peer_fused"] = {"peer": best, "ms_median": fused[best]} if best else None
        row["ratio_ours_over_best_peer"] = ratio(ms(v, "prep_kda"), fused.get(best)) if best else None
        row["ratio_kda_over_best_peer_fused"] = ratio(ms(v, "kda"), fused.get(best)) if best else None
        row["ratio_kda_over_fla_kernel"] = ratio(ms(v, "kda"), ms(pv, "fla.kernel"))
        # The tensor-core kernel (fast numerics; bf16 operands like the peers'), same scopes.
        row["ratio_tc_over_best_peer"] = ratio(ms(v, "prep_kda_tc"), fused.get(best)) if best else None
        row["ratio_tc_over_fla_kernel"] = ratio(ms(v, "kda_tc"), ms(pv, "fla.kernel"))
        rows.append(row)
    meta_ours = {k: val for k, val in ours.items() if k != "cases"}
    meta_peers = {k: val for k, val in peers.items() if k not in ("cases", "correctness")}
    return {
        "generated_by": "bash scripts/measure_kda_peers.sh (one device call: k3_kda_gpu_bench, then "
                        "tools/peer/kda_peers.py; merged by tools/kda_peer_table.py merge)",
        "gpu": ours.get("gpu"),
        "ours_run": meta_ours,
        "peers_run": meta_peers,
        "ratio_definitions": {
            "ratio_ours_over_best_peer": "ours prep+kda ms / fastest peer fused call ms (same scope: raw q, k, "
                                         "f, beta logits -> o); > 1: ours slower",
            "ratio_kda_over_best_peer_fused": "our KDA kernel alone / fastest peer fused call",
            "ratio_kda_over_fla_kernel": "our KDA kernel / fla on the same prepared inputs",
            "ratio_tc_over_best_peer": "ours prep + tensor-core KDA / fastest peer fused call",
            "ratio_tc_over_fla_kernel": "our tensor-core KDA kernel / fla on the same prepared inputs",
        },
        "rows": rows,
        "correctness": peers.get("correctness"),
    }


def f3(x):
    return "-" if x is None else (f"{x:.3f}" if x < 100 else f"{x:.1f}")


def fr(x):
    return "-" if x is None else f"{x:.2f}x"


def fe(x):
    return "-" if x is None else f"{x:.1e}"


def table(doc):
    out = []
    pr = doc.get("peers_run", {})
    orun = doc.get("ours_run", {})
    out.append(f"# KDA kernels beside FlashKDA and fla on {doc.get('gpu')}")
    out.append("")
    out.append("Made by `bash scripts/measure_kda_peers.sh` on the GPU machine (one device call runs "
               "`k3_kda_gpu_bench` and `tools/peer/kda_peers.py` one after the other); data: "
               "`docs/data/kda-peers-gpu.json`, this page: `python3 tools/kda_peer_table.py table "
               "docs/data/kda-peers-gpu.json -o docs/data/kda-peers-gpu.md`.")
    out.append("")
    peers = pr.get("peers", {})
    vers = []
    for n, p in peers.items():
        vers.append(f"{n} {p.get('version')}" if p.get("available") else f"{n}: not available ({p.get('error')})")
    out.append(f"Peers: {'; '.join(vers)}. torch {pr.get('torch')}, triton {pr.get('triton')}. "
               f"Median of {orun.get('reps')} runs after {orun.get('warmup')} warm-up runs, each timed with CUDA "
               f"events; D = Dk = Dv = {orun.get('D')}, chunk {orun.get('chunk')} (ours), gate lower bound "
               f"{orun.get('lower_bound')}. Ours: fp32 inputs and state; peers: bf16 inputs, fp32 state.")
    out.append("")
    out.append("Scopes: *ours kda* is the engine's KDA call alone (`kda_chunked_varlen` / "
               "`kda_recurrent_varlen`) on prepared q, k, g, beta; *ours prep+kda* adds the model's preparation "
               "(q, k L2 norm, q scale, decay gate, beta sigmoid), the work FlashKDA and fla's fused mode do in "
               "their call; *fla kernel* is fla on the same prepared inputs. Gates: *strong* is FlashKDA's own "
               "benchmark distribution (g about -3 per token: our chunks end early, see *chunk*), *mild* has g in "
               "about [-0.5, -0.01]. *ours/best* = ours prep+kda over the fastest peer's fused call "
               "(above 1: ours slower). *ours tc*: the tensor-core kernel of `fast` numerics "
               "(`kda_chunked_tc_varlen`, bf16 operands as the peers', fp32 state); *tc vs fp32*: rel-L2 of its "
               "output from the fp32 kernel's on the same inputs.")
    out.append("")
    hdr = ["case", "gate", "ours kda", "ours prep+kda", "ours tc kda", "ours tc prep+kda"] + \
          [lbl for _, lbl in PEER_COLS] + ["ours/best", "kda/fla kernel", "tc/best", "tc/fla kernel", "tc vs fp32",
                                           "chunk"]
    out.append("| " + " | ".join(hdr) + " |")
    out.append("|" + "|".join(["---"] * 2 + ["---:"] * (len(hdr) - 2)) + "|")
    for r in doc.get("rows", []):
        def cell(d, key):
            v = d.get(key) if d else None
            if not isinstance(v, dict):
                return "-"
            s = f3(v.get("ms_median"))
            if v.get("state_gbs"):
                s += f" ({v['state_gbs']:.0f} GB/s)"
            return s
        pe = r.get("peer_errors") or {}
        cells = [r["name"], r["gate"], cell(r["ours"], "kda"), cell(r["ours"], "prep_kda"), cell(r["ours"], "kda_tc"),
                 cell(r["ours"], "prep_kda_tc")]
        for key, _ in PEER_COLS:
            cells.append("error" if key in pe else cell(r["peers"], key))
        chunk = r.get("mean_chunk_len_est")
        tc = (r.get("ours") or {}).get("kda_tc") or {}
        tcerr = tc.get("rel_l2_vs_fp32_kernel")
        cells += [fr(r.get("ratio_ours_over_best_peer")), fr(r.get("ratio_kda_over_fla_kernel")),
                  fr(r.get("ratio_tc_over_best_peer")), fr(r.get("ratio_tc_over_fla_kernel")),
                  "-" if tcerr is None else f"{tcerr:.1e}", "-" if chunk is None else f"{chunk:.1f}"]
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    out.append("Times in ms (median); decode rows add the fp32 state read + written per second. "
               "*chunk*: our mean chunk length on the first 1024 tokens (64 unless a channel's log-decay passes "
               "80 within the chunk).")
    errs = [(r["name"], r["gate"], k, v) for r in doc.get("rows", []) for k, v in (r.get("peer_errors") or {}).items()]
    if errs:
        out.append("")
        out.append("Peer errors:")
        for n, g, k, v in errs:
            out.append(f"- {n} ({g}) {k}: {str(v).splitlines()[0] if str(v) else v}")
    corr = doc.get("correctness")
    out.append("")
    out.append("## Same function: relative L2 against a float64 recurrence")
    out.append("")
    if isinstance(corr, list) and corr:
        out.append("Small cases dumped by `k3_kda_gpu_bench --dump` (raw inputs, our prepared inputs, our outputs); "
                   "each peer computes from the raw (fused) or prepared inputs, the reference from our prepared "
                   "inputs in float64. *prep* is our preparation against its formula.")
        out.append("")
        out.append("| dump case | impl | o vs fp64 | o vs ours | final state vs fp64 |")
        out.append("|---|---|---:|---:|---:|")
        for c in corr:
            prep = c.get("prep_rel_l2_vs_formula", {})
            out.append(f"| {c['tag']} (rows {c['rows']}, H {c['H']}, {c['seqs']} seq) | prep q/k/g/beta | "
                       + " / ".join(fe(prep.get(k)) for k in ("q", "k", "g", "beta")) + " | - | - |")
            for impl, v in c.get("checks", {}).items():
                if "error" in v:
                    out.append(f"| | {impl} | error: {v['error']} | | |")
                else:
                    out.append(f"| | {impl} | {fe(v.get('o_vs_ref64'))} | {fe(v.get('o_vs_ours'))} | "
                               f"{fe(v.get('S_vs_ref64'))} |")
    else:
        out.append(f"Not run: {corr!r}")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge")
    m.add_argument("ours")
    m.add_argument("peers")
    m.add_argument("-o", "--out", required=True)
    t = sub.add_parser("table")
    t.add_argument("merged")
    t.add_argument("-o", "--out")
    a = ap.parse_args()
    if a.cmd == "merge":
        ours = json.load(open(a.ours))
        try:
            peers = json.load(open(a.peers))
        except (OSError, ValueError) as e:
            peers = {"cases": [], "correctness": {"error": f"no peer results: {e}"}}
        with open(a.out, "w") as f:
            json.dump(merge(ours, peers), f, indent=2)
            f.write("\n")
        return 0
    text = table(json.load(open(a.merged)))
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
