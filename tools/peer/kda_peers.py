#!/usr/bin/env python3
"""Peer half of the side-by-side KDA benchmark (issue 19, goal 4): FlashKDA (PyPI tokenspeed-flashkda,
module flash_kda) and fla (PyPI fla-core, fla.ops.kda: chunk_kda / fused_recurrent_kda) timed at the
shapes bench/kda_gpu_bench.cpp times ours at, in the same device call, with the same policy (CUDA
events around each run, warm-up, then median/min/max over --reps), and checked against the arrays that
`k3_kda_gpu_bench --dump DIR` wrote (rel-L2 of the outputs against a float64 recurrence and against ours).
cuLA (PyPI cuda-linear-attention) is reported as unavailable when it cannot be imported.

Semantics matched to ours (ops.h kda_recurrent; model/layers.cpp prepares the inputs):
  q <- q * D^-1/2 / sqrt(sum q^2 + 1e-6), k <- k / sqrt(sum k^2 + 1e-6)   (fla: use_qk_l2norm_in_kernel
        + scale=D^-1/2; FlashKDA always normalises q and k and takes `scale`)
  g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h, d])), lower_bound = -5   (fla:
        use_gate_in_kernel + safe_gate + lower_bound; FlashKDA takes f, A_log [H], dt_bias [H, K])
  beta = sigmoid(beta_logit)   (fla: use_beta_sigmoid_in_kernel; FlashKDA always takes logits)
  S <- diag(exp g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q.  State [N, H, K, V] in fla's default
        layout (ours too); FlashKDA keeps it as [N, H, V, K].
Two scopes are timed: "fused" (raw q, k, f, beta logits -> o, what FlashKDA does in its kernels; ours:
prep + kda) and "kernel" (prepared q, k, g, beta -> o; fla only; ours: kda).

fla's backend dispatch is switched off (FLA_DISABLE_BACKEND_DISPATCH=1, read when fla is imported),
so chunk_kda is fla's own Triton path even though flash_kda is importable (fla would otherwise hand
inference calls with these flags to FlashKDA).

JSON on stdout (or --out FILE); progress on stderr.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

D = 128
LOWER_BOUND = -5.0
EPS = 1e-6

# Same names and shapes as bench/kda_gpu_bench.cpp all_cases(): (name, kind, T per sequence, H, seqs).
CASES = [
    ("prefill_T8192_H96", "prefill", 8192, 96, 1),
    ("prefill_T8192_H64", "prefill", 8192, 64, 1),
    ("prefill_T16384_H64", "prefill", 16384, 64, 1),
    ("prefill_T32768_H12", "prefill", 32768, 12, 1),
    ("prefill_T131072_H12", "prefill", 131072, 12, 1),
    ("varlen_8x1024_H96", "varlen_prefill", 1024, 96, 8),
    ("decode_N64_H96", "decode", 1, 96, 64),
]


def log(*a):
    print("kda_peers:", *a, file=sys.stderr, flush=True)


def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def load_peers():
    peers = {}
    try:
        import flash_kda  # noqa: F401

        peers["flashkda"] = {"available": True, "module": flash_kda, "version": version("tokenspeed-flashkda")}
    except Exception as e:  # an ABI mismatch with the installed torch shows up here
        peers["flashkda"] = {"available": False, "error": f"{type(e).__name__}: {e}"}
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda

        try:
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        except ImportError:
            fused_recurrent_kda_fwd = None
        peers["fla"] = {"available": True, "chunk_kda": chunk_kda, "fused_recurrent_kda": fused_recurrent_kda,
                        "fused_recurrent_kda_fwd": fused_recurrent_kda_fwd, "version": version("fla-core"),
                        "dispatch_disabled": os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1"}
    except Exception as e:
        peers["fla"] = {"available": False, "error": f"{type(e).__name__}: {e}"}
    try:
        import cula  # noqa: F401

        peers["cula"] = {"available": True, "version": version("cuda-linear-attention"),
                         "note": "importable, but no timing is wired for it (its KDA API was not available to match)"}
    except Exception as e:
        peers["cula"] = {"available": False, "error": f"{type(e).__name__}: {e}",
                         "note": "PyPI served no installable file of cuda-linear-attention for cp312 / linux x86_64"}
    return peers


def public(peers):
    return {n: {k: v for k, v in p.items() if isinstance(v, (str, bool, int, float)) or v is None}
            for n, p in peers.items()}


# ---------------------------------------------------------------- timing (same policy as ours)
def time_on(fn, warmup, reps, setup=None):
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(reps):
        if setup:
            setup()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        pairs.append((a, b))
    torch.cuda.synchronize()
    ms = sorted(a.elapsed_time(b) for a, b in pairs)
    n = len(ms)
    med = ms[n // 2] if n % 2 else 0.5 * (ms[n // 2 - 1] + ms[n // 2])
    return {"ms_median": med, "ms_min": ms[0], "ms_max": ms[-1]}


def with_rates(st, rows, state_bytes):
    st["tokens_per_s"] = rows / (st["ms_median"] * 1e-3)
    if state_bytes:
        st["state_gbs"] = state_bytes / (st["ms_median"] * 1e-3) / 1e9
    return st


# ---------------------------------------------------------------- inputs
def make_inputs(rows, H, gate, seed, dev):
    """Raw inputs with the distributions of bench/kda_gpu_bench.cpp (the same law, not the same values)."""
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    shp = (1, rows, H, D)
    x = {
        "q_raw": torch.randn(shp, device=dev, generator=gen),
        "k_raw": torch.randn(shp, device=dev, generator=gen),
        "v": torch.randn(shp, device=dev, generator=gen),
        "beta_logit": torch.randn((1, rows, H), device=dev, generator=gen),
    }
    if gate == "strong":
        x["f"] = torch.randn(shp, device=dev, generator=gen)
        x["A_log"] = torch.rand(H, device=dev, generator=gen)
        x["dt_bias"] = torch.rand(H, D, device=dev, generator=gen)
    else:
        x["f"] = torch.rand(shp, device=dev, generator=gen) * 4 - 2
        x["A_log"] = torch.zeros(H, device=dev)
        x["dt_bias"] = torch.full((H, D), -4.2, device=dev)
    return x


def l2n(t):
    return t / torch.sqrt((t * t).sum(-1, keepdim=True) + EPS)


def gate_of(f, A_log, dt_bias):
    H = A_log.shape[0]
    return LOWER_BOUND * torch.sigmoid(torch.exp(A_log.view(1, 1, H, 1)) * (f + dt_bias.view(1, 1, H, D)))


# ---------------------------------------------------------------- peer calls
def flashkda_call(fk, q, k, v, f, bl, A_log, dt_bias, out, init, final, cu):
    # Every optional tensor given (a zero state, [0, T] for one sequence): the 0.0.1.post20260901
    # wheel refused None there with "all tensors must be on CUDA" on the H200 (2026-12-03).
    if init is None:
        init = torch.zeros_like(final)
    if cu is None:
        cu = torch.tensor([0, q.shape[1]], dtype=torch.long, device=q.device)
    fk.fwd(q, k, v, f, bl, D ** -0.5, out, A_log=A_log, dt_bias=dt_bias, lower_bound=LOWER_BOUND,
           initial_state=init, final_state=final, cu_seqlens=cu)


def fla_chunk_fused(fla, q, k, v, f, bl, A_log, dt_bias, cu, cu_cpu, init=None, scale=D ** -0.5):
    return fla["chunk_kda"](q=q, k=k, v=v, g=f, beta=bl, scale=scale, initial_state=init, output_final_state=True,
                            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                            safe_gate=True, lower_bound=LOWER_BOUND, A_log=A_log, dt_bias=dt_bias.reshape(-1),
                            cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)


def fla_chunk_kernel(fla, q, k, v, g, beta, cu, cu_cpu, init=None, scale=D ** -0.5, safe_gate=True):
    return fla["chunk_kda"](q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=init, output_final_state=True,
                            safe_gate=safe_gate, lower_bound=LOWER_BOUND if safe_gate else None, cu_seqlens=cu,
                            cu_seqlens_cpu=cu_cpu)


def fla_recurrent(fla, q, k, v, g, beta, S, cu, slots, fused, A_log=None, dt_bias=None, scale=D ** -0.5, out=None):
    """Decode: one token per sequence, the state pool updated in place at slots (vLLM's form); falls back
    to the public fused_recurrent_kda (new final-state tensor) when the internal entry point is absent."""
    kw = dict(use_qk_l2norm_in_kernel=fused, use_gate_in_kernel=fused, use_beta_sigmoid_in_kernel=fused,
              lower_bound=LOWER_BOUND if fused else None, A_log=A_log if fused else None,
              dt_bias=dt_bias.reshape(-1) if fused else None)
    if fla["fused_recurrent_kda_fwd"] is not None and slots is not None:
        return fla["fused_recurrent_kda_fwd"](q=q, k=k, v=v, g=g, beta=beta, initial_state=S, scale=scale,
                                              inplace_final_state=True, cu_seqlens=cu, ssm_state_indices=slots, out=out,
                                              **kw)
    return fla["fused_recurrent_kda"](q=q, k=k, v=v, g=g, beta=beta, initial_state=S, scale=scale,
                                      output_final_state=True, cu_seqlens=cu, **kw)


# ---------------------------------------------------------------- one timed case
def run_case(name, kind, T, H, seqs, gate, peers, args, dev):
    rows = T * seqs
    log(f"{name} gate={gate} ...")
    x = make_inputs(rows, H, gate, 1000 + rows * 7 + H, dev)
    bf = {n: x[n].to(torch.bfloat16) for n in ("q_raw", "k_raw", "v", "f", "beta_logit")}
    qn, kn = l2n(x["q_raw"]).to(torch.bfloat16), l2n(x["k_raw"]).to(torch.bfloat16)
    g32 = gate_of(x["f"], x["A_log"], x["dt_bias"]).float()
    beta_bf = torch.sigmoid(x["beta_logit"]).to(torch.bfloat16)
    A_log, dt_bias = x["A_log"].float().contiguous(), x["dt_bias"].float().contiguous()
    varlen = seqs > 1 or kind == "decode"
    cu_list = [i * T for i in range(seqs + 1)]
    cu = torch.tensor(cu_list, dtype=torch.long, device=dev) if varlen else None
    cu_cpu = torch.tensor(cu_list, dtype=torch.long) if varlen else None
    state_bytes = 2.0 * seqs * H * D * D * 4 if kind == "decode" else 0.0
    res = {"name": name, "kind": kind, "gate": gate, "T": T, "H": H, "D": D, "seqs": seqs, "rows": rows,
           "peers": {}, "errors": {}}
    if state_bytes:
        res["state_bytes_read_written"] = state_bytes

    def attempt(label, what, fn, setup=None):
        try:
            st = time_on(fn, args.warmup, args.reps, setup)
            st = with_rates(st, rows, state_bytes)
            st["what"] = what
            res["peers"][label] = st
            log(f"  {label}: {st['ms_median']:.4f} ms")
        except Exception as e:
            res["errors"][label] = f"{type(e).__name__}: {e}"
            log(f"  {label}: FAILED {type(e).__name__}: {e}")
            if args.verbose:
                traceback.print_exc()

    fk = peers["flashkda"]
    if fk["available"]:
        out = torch.empty_like(bf["v"])
        if kind == "decode":
            S_in = (torch.randn(seqs, H, D, D, device=dev) * 0.05).contiguous()
            S_out = torch.empty_like(S_in)
            attempt("flashkda.fused", "flash_kda.fwd, cu_seqlens of 1-token sequences, fp32 state in + out "
                    "(FlashKDA has no separate decode kernel)",
                    lambda: flashkda_call(fk["module"], bf["q_raw"], bf["k_raw"], bf["v"], bf["f"], bf["beta_logit"],
                                          A_log, dt_bias, out, S_in, S_out, cu))
            del S_in, S_out
        else:
            S_out = torch.empty(seqs, H, D, D, device=dev)
            attempt("flashkda.fused", "flash_kda.fwd bf16, no initial state, fp32 final state",
                    lambda: flashkda_call(fk["module"], bf["q_raw"], bf["k_raw"], bf["v"], bf["f"], bf["beta_logit"],
                                          A_log, dt_bias, out, None, S_out, cu))
            del S_out
        del out
    fla = peers["fla"]
    if args.fla_cases != "all" and name not in args.fla_cases.split(","):
        fla = {"available": False}
    if fla["available"]:
        if kind == "decode":
            S = (torch.randn(seqs, H, D, D, device=dev) * 0.05).contiguous()
            slots = torch.arange(seqs, dtype=torch.int32, device=dev)
            out = torch.empty_like(bf["v"])
            attempt("fla.fused", "fused_recurrent_kda (Triton), l2norm/gate/sigmoid in kernel, fp32 state in place",
                    lambda: fla_recurrent(fla, bf["q_raw"], bf["k_raw"], bf["v"], bf["f"], bf["beta_logit"], S, cu,
                                          slots, True, A_log, dt_bias, out=out))
            attempt("fla.kernel", "fused_recurrent_kda (Triton) on prepared q, k, g, beta, fp32 state in place",
                    lambda: fla_recurrent(fla, qn, kn, bf["v"], g32, beta_bf, S, cu, slots, False, out=out))
            del S, out
        else:
            attempt("fla.fused", "chunk_kda (Triton), l2norm/gate/sigmoid in kernel, safe_gate, fp32 final state",
                    lambda: fla_chunk_fused(fla, bf["q_raw"], bf["k_raw"], bf["v"], bf["f"], bf["beta_logit"], A_log,
                                            dt_bias, cu, cu_cpu))
            attempt("fla.kernel", "chunk_kda (Triton) on prepared q, k, g (fp32), beta, safe_gate, fp32 final state",
                    lambda: fla_chunk_kernel(fla, qn, kn, bf["v"], g32, beta_bf, cu, cu_cpu))
    del x, bf, qn, kn, g32, beta_bf
    torch.cuda.empty_cache()
    fused = {k: v["ms_median"] for k, v in res["peers"].items() if k.endswith(".fused")}
    if fused:
        best = min(fused, key=fused.get)
        res["best_fused"] = {"peer": best, "ms_median": fused[best]}
    return res


# ---------------------------------------------------------------- correctness against the dump
def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-300))


def ref_recurrence(q, k, v, g, beta, S0, cu):
    """float64 reference of ops.h kda_recurrent per sequence (q already scaled). Shapes [rows,H,D], S0 [N,H,K,V]."""
    q, k, v, g, beta, S = (t.double() for t in (q, k, v, g, beta, S0))
    S = S.clone()
    o = torch.empty_like(v)
    for i in range(len(cu) - 1):
        s = S[i]
        for t in range(cu[i], cu[i + 1]):
            s = s * torch.exp(g[t])[:, :, None]
            u = torch.einsum("hkv,hk->hv", s, k[t])
            d = beta[t][:, None] * (v[t] - u)
            s = s + k[t][:, :, None] * d[:, None, :]
            o[t] = torch.einsum("hkv,hk->hv", s, q[t])
        S[i] = s
    return o, S


def check_dump(dump_dir, peers, dev):
    man = json.loads((Path(dump_dir) / "kda_dump.json").read_text())
    out = []
    for c in man["cases"]:
        rows, H, N, cu_list = c["rows"], c["H"], c["seqs"], c["cu_seqlens"]

        def ld(name, shape):
            a = np.fromfile(Path(dump_dir) / c["files"][name], dtype="<f4").reshape(shape)
            return torch.from_numpy(a).to(dev)

        td, th = (rows, H, D), (rows, H)
        a = {n: ld(n, td) for n in ("q_raw", "k_raw", "q", "k", "v", "f", "g", "o")}
        a.update({n: ld(n, th) for n in ("beta_logit", "beta")})
        a["A_log"], a["dt_bias"] = ld("A_log", (H,)), ld("dt_bias", (H, D))
        a["S0"], a["S"] = ld("S0", (N, H, D, D)), ld("S", (N, H, D, D))
        o_ref, S_ref = ref_recurrence(a["q"], a["k"], a["v"], a["g"], a["beta"], a["S0"], cu_list)
        # Our preparation against the stated formulas (float64): shows the dumped prepared arrays mean
        # what the peers compute from the raw ones.
        prep = {
            "q": rel_l2(a["q"], l2n(a["q_raw"].double()) * D ** -0.5),
            "k": rel_l2(a["k"], l2n(a["k_raw"].double())),
            "g": rel_l2(a["g"], gate_of(a["f"].double()[None], a["A_log"].double(), a["dt_bias"].double())[0]),
            "beta": rel_l2(a["beta"], torch.sigmoid(a["beta_logit"].double())),
        }
        checks = {"ours": {"o_vs_ref64": rel_l2(a["o"], o_ref), "S_vs_ref64": rel_l2(a["S"], S_ref), "dtype": "fp32"}}

        def record(label, fn):
            try:
                o, S = fn()
                r = {"o_vs_ref64": rel_l2(o.reshape(td), o_ref), "o_vs_ours": rel_l2(o.reshape(td), a["o"])}
                if S is not None:
                    r["S_vs_ref64"] = rel_l2(S, S_ref)
                checks[label] = r
            except Exception as e:
                checks[label] = {"error": f"{type(e).__name__}: {e}"}

        cu = torch.tensor(cu_list, dtype=torch.long, device=dev)
        cu_cpu = torch.tensor(cu_list, dtype=torch.long)
        b = lambda t: t[None].to(torch.bfloat16).contiguous()  # noqa: E731
        f32 = lambda t: t[None].float().contiguous()  # noqa: E731
        fla = peers["fla"]
        if fla["available"]:
            # fp32, prepared inputs, kernel scale 1 (q is already scaled): the same function in the same precision.
            record("fla.recurrent.fp32", lambda: fla["fused_recurrent_kda"](
                q=f32(a["q"]), k=f32(a["k"]), v=f32(a["v"]), g=f32(a["g"]), beta=f32(a["beta"]), scale=1.0,
                initial_state=a["S0"].clone(), output_final_state=True, cu_seqlens=cu))
            if c["kind"] != "decode":
                record("fla.chunk.fp32", lambda: fla_chunk_kernel(
                    fla, f32(a["q"]), f32(a["k"]), f32(a["v"]), f32(a["g"]), f32(a["beta"]), cu, cu_cpu,
                    init=a["S0"].clone(), scale=1.0, safe_gate=False))
                record("fla.chunk.fused.bf16", lambda: fla_chunk_fused(
                    fla, b(a["q_raw"]), b(a["k_raw"]), b(a["v"]), b(a["f"]), b(a["beta_logit"]), a["A_log"].float(),
                    a["dt_bias"].float(), cu, cu_cpu, init=a["S0"].clone()))
            else:
                record("fla.recurrent.fused.bf16", lambda: fla["fused_recurrent_kda"](
                    q=b(a["q_raw"]), k=b(a["k_raw"]), v=b(a["v"]), g=b(a["f"]), beta=b(a["beta_logit"]),
                    scale=D ** -0.5, initial_state=a["S0"].clone(), output_final_state=True, cu_seqlens=cu,
                    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                    lower_bound=LOWER_BOUND, A_log=a["A_log"].float(), dt_bias=a["dt_bias"].float().reshape(-1)))
        fk = peers["flashkda"]
        if fk["available"]:
            def run_fk():
                o = torch.empty((1, rows, H, D), dtype=torch.bfloat16, device=dev)
                S_in = a["S0"].transpose(-1, -2).contiguous()  # FlashKDA's state is [N, H, V, K]
                S_out = torch.empty_like(S_in)
                flashkda_call(fk["module"], b(a["q_raw"]), b(a["k_raw"]), b(a["v"]), b(a["f"]), b(a["beta_logit"]),
                              a["A_log"].float().contiguous(), a["dt_bias"].float().contiguous(), o, S_in, S_out, cu)
                return o, S_out.transpose(-1, -2)
            record("flashkda.fused.bf16", run_fk)
        out.append({"tag": c["tag"], "kind": c["kind"], "gate": c["gate"], "rows": rows, "H": H, "seqs": N,
                    "prep_rel_l2_vs_formula": prep, "checks": checks})
        log(f"check {c['tag']}: " + ", ".join(
            f"{k} {v.get('o_vs_ref64', float('nan')):.2e}" if "error" not in v else f"{k} ERROR"
            for k, v in checks.items()))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="all", help="all or a comma list of case names")
    ap.add_argument("--gate", default="both", choices=["strong", "mild", "both"])
    ap.add_argument("--fla-cases", default="all", help="all or a comma list: the cases fla is timed on")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dump", help="directory written by k3_kda_gpu_bench --dump (correctness check)")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--out", help="write the JSON here instead of stdout")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        log("no CUDA device")
        return 3
    dev = torch.device("cuda")
    peers = load_peers()
    for n, p in public(peers).items():
        log(f"{n}: " + ("available " + str(p.get("version")) if p["available"] else "unavailable: " + p["error"]))
    names = [c[0] for c in CASES]
    want = names if args.cases == "all" else [s for s in args.cases.split(",") if s]
    unknown = [w for w in want if w not in names]
    if unknown:
        log("unknown cases: " + ", ".join(unknown) + "; known: " + ", ".join(names))
        return 2
    gates = ["strong", "mild"] if args.gate == "both" else [args.gate]
    doc = {"tool": "tools/peer/kda_peers.py", "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "triton": version("triton"), "python": sys.version.split()[0], "warmup": args.warmup, "reps": args.reps,
           "timing": "torch.cuda.Event around each run on the current stream; median/min/max over reps after warm-up "
                     "(the first warm-up run compiles and autotunes the Triton kernels)",
           "inputs": "bf16 q, k, v, f, beta logits ~ N(0,1) (f per the gate), A_log/dt_bias fp32; state fp32",
           "peers": public(peers), "cases": [], "correctness": None}
    t0 = time.time()

    def save(final):
        # With --out the document is rewritten after every case, so a run stopped by a time limit
        # still leaves what it measured ("complete": false).
        doc["wall_s"] = round(time.time() - t0, 1)
        doc["complete"] = final
        text = json.dumps(doc, indent=2)
        if args.out:
            tmp = Path(args.out + ".tmp")
            tmp.write_text(text + "\n")
            tmp.replace(args.out)
        elif final:
            print(text)

    # Timings first, then the correctness check (it compiles the fp32 variants of fla's kernels): under
    # a time limit the timings are the part that must not be lost.
    with torch.inference_mode():
        if not args.no_timing:
            for (name, kind, T, H, seqs) in CASES:
                if name in want:
                    for g in gates:
                        try:
                            doc["cases"].append(run_case(name, kind, T, H, seqs, g, peers, args, dev))
                        except Exception as e:  # e.g. out of memory while making the inputs
                            log(f"{name} gate={g}: FAILED {type(e).__name__}: {e}")
                            doc["cases"].append({"name": name, "kind": kind, "gate": g, "peers": {},
                                                 "errors": {"all": f"{type(e).__name__}: {e}"}})
                            torch.cuda.empty_cache()
                        save(False)
        if args.dump:
            try:
                doc["correctness"] = check_dump(args.dump, peers, dev)
            except Exception as e:
                doc["correctness"] = {"error": f"{type(e).__name__}: {e}"}
                log("correctness check failed: " + doc["correctness"]["error"])
                if args.verbose:
                    traceback.print_exc()
    save(True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
