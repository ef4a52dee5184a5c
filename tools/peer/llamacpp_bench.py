#!/usr/bin/env python3
"""Peer benchmark: llama.cpp's own Kimi K3 / Kimi Linear implementation (llama-cpp-python 0.3.36) on a k3cpp checkpoint.

For one checkpoint directory (released K3 layout, or a flat `kimi_linear` checkpoint):
  1. convert it to GGUF with llama.cpp's vendored converter (tools/peer/k3_to_gguf.py; BF16 trunk,
     K3's MXFP4 routed experts repacked losslessly to ggml MXFP4, Kimi Linear's bf16 experts stay
     BF16), cached under build/peer-gguf/;
  2. benchmark llama.cpp llama-bench style: ppN = one prefill of N seeded random ids from an empty
     context (logits of the last token only), tgN = N single-token decode steps from an empty
     context, each fed the argmax of the previous step (the same definitions as `k3 bench`); one
     warm-up run per test, then -r timed runs; t/s = mean +- sample stddev of the per-run t/s;
  3. optionally run `k3 bench` with the same N, repetitions and threads (--with-k3), and with
     --rounds K alternate the two engines K times (ABAB..., the first engine of a round
     alternating) and report the median of the per-round k3 / llama.cpp ratios, so that the
     machine's drift between the two engines' runs cancels;
  4. correctness cross-check: teacher-forced logits of llama.cpp for the same ids (one prefill, and
     token-by-token decode) against `k3 logits` (and against the checkpoint's fp64 reference
     logits when it has reference.json + logits.f32): relative L2, max |diff|, argmax agreement.

Token ids are fed directly (no tokenizer involved). JSON on stdout (and --json-out FILE), a short
table on stderr. Needs the peer venv (scripts/peer_llamacpp.sh sets it up).
"""
from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
DEFAULT_LLAMA_SRC = REPO / "build" / "peer-src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
DEFAULT_CACHE = REPO / "build" / "peer-gguf"
CONVERTER = Path(__file__).resolve().parent / "k3_to_gguf.py"


def eprint(*a):
    print(*a, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# conversion (cached)
# --------------------------------------------------------------------------------------------

def cache_key(ckpt: Path, outtype: str, llama_src: Path) -> str:
    h = hashlib.sha256()
    h.update(f"outtype={outtype};llama-cpp-python={LLAMA_CPP_PYTHON_VERSION}\n".encode())
    h.update(CONVERTER.read_bytes())
    for p in sorted(ckpt.iterdir()):
        if p.suffix == ".safetensors":
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
        elif p.name in ("config.json", "model.safetensors.index.json", "tiktoken.model",
                        "tokenizer_config.json"):
            h.update(p.name.encode() + b"\n" + p.read_bytes())
    for rel in ("conversion/kimi_k3.py", "conversion/kimi_linear.py", "conversion/base.py"):
        f = llama_src / rel
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def ensure_gguf(args) -> tuple[Path, bool, float]:
    if args.gguf:
        return Path(args.gguf), False, 0.0
    ckpt = Path(args.ckpt).resolve()
    llama_src = Path(args.llama_src)
    if not (llama_src / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"error: llama.cpp sources not found at {llama_src} (run scripts/peer_llamacpp.sh)")
    key = cache_key(ckpt, args.outtype, llama_src)
    out = Path(args.cache_dir) / f"{ckpt.name}-{args.outtype}-{key}.gguf"
    if out.is_file() and not args.reconvert:
        return out, False, 0.0
    cmd = [sys.executable, str(CONVERTER), str(ckpt), str(out), "--llama-src", str(llama_src),
           "--outtype", args.outtype]
    if shutil.which("nice"):
        cmd = ["nice", "-n", "19"] + cmd
    eprint(f"converting {ckpt} -> {out}")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    dt = time.perf_counter() - t0
    log = out.with_suffix(".convert.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(r.stdout)
    if r.returncode != 0:
        eprint("\n".join(r.stdout.splitlines()[-30:]))
        raise SystemExit(f"error: conversion failed (exit {r.returncode}); full log {log}")
    return out, True, dt


def llama_src_commit(llama_src: Path) -> str | None:
    """The llama.cpp commit the sdist vendors (its tarball carries llama.cpp's .git)."""
    try:
        r = subprocess.run(["git", "-C", str(llama_src), "log", "-1", "--format=%H %cs"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=20)
        top = subprocess.run(["git", "-C", str(llama_src), "rev-parse", "--show-toplevel"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=20)
        if r.returncode == 0 and Path(top.stdout.strip()).resolve() == llama_src.resolve():
            return r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def host_info() -> dict:
    """CPU model and SIMD flags (Linux /proc/cpuinfo), memory, k3cpp commit."""
    out: dict = {"cpu_count": os.cpu_count(), "machine": platform.machine(), "kernel": platform.release()}
    try:
        info = Path("/proc/cpuinfo").read_text()
        for line in info.splitlines():
            k, _, v = line.partition(":")
            k = k.strip()
            if k == "model name" and "cpu_model" not in out:
                out["cpu_model"] = v.strip()
            elif k == "flags" and "cpu_flags_simd" not in out:
                fl = v.split()
                out["cpu_flags_simd"] = [f for f in fl if f.startswith(("avx", "fma", "f16c", "amx", "sse4", "bmi"))]
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                out["mem_total_kib"] = int(line.split()[1])
    except OSError:
        pass
    try:
        r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True, timeout=20)
        d = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=20)
        if r.returncode == 0:
            out["k3cpp_commit"] = r.stdout.strip() + ("-dirty" if d.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def summarize(rounds: list[dict]) -> dict:
    """Per test: each engine's per-round t/s (mean of that round's repetitions) -> median, min, max;
    the per-round k3 / llama.cpp ratios -> median, min, max."""
    out: dict = {}
    tests = [x["test"] for x in rounds[0]["llama_cpp"]]
    for t in tests:
        e: dict = {}
        for eng, get in (("llama_cpp", lambda r: r["llama_cpp"]), ("k3", lambda r: r["k3"]["results"])):
            v = [x["avg_ts"] for r in rounds if eng in r for x in get(r) if x["test"] == t]
            if v:
                e[eng] = {"median_ts": statistics.median(v), "min_ts": min(v), "max_ts": max(v), "per_round_ts": v}
        q = [r["k3_over_llama_cpp"][t] for r in rounds if t in r.get("k3_over_llama_cpp", {})]
        if q:
            e["k3_over_llama_cpp"] = {"median": statistics.median(q), "min": min(q), "max": max(q), "per_round": q}
        out[t] = e
    return out


def gguf_summary(path: Path, llama_src: Path) -> dict:
    """Tensor-type census of the GGUF (vendored gguf-py reader)."""
    sys.path.insert(0, str(llama_src / "gguf-py"))
    try:
        import gguf  # noqa: WPS433
        r = gguf.GGUFReader(str(path))
        types: dict[str, int] = {}
        nbytes: dict[str, int] = {}
        for t in r.tensors:
            k = t.tensor_type.name
            types[k] = types.get(k, 0) + 1
            nbytes[k] = nbytes.get(k, 0) + int(t.n_bytes)
        exps = sorted({t.tensor_type.name for t in r.tensors if "_exps" in t.name})
        return {"tensor_types": types, "tensor_bytes": nbytes, "expert_types": exps,
                "n_tensors": len(r.tensors)}
    except Exception as e:  # reporting only
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        sys.path.pop(0)


# --------------------------------------------------------------------------------------------
# llama.cpp through llama-cpp-python's low-level ctypes API
# --------------------------------------------------------------------------------------------

class Peer:
    CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30}   # ggml_type
    FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}      # llama_flash_attn_type

    def __init__(self, gguf_path: Path, n_threads: int, n_ctx: int, n_batch: int, verbose: bool,
                 cache_type: str = "f16", flash_attn: str = "auto"):
        import llama_cpp as L
        self.L = L
        self._log_cb = None
        if not verbose:
            @L.llama_log_callback
            def _quiet(level, text, user_data):  # noqa: ARG001
                return None
            self._log_cb = _quiet
            L.llama_log_set(self._log_cb, ctypes.c_void_p(0))
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        t0 = time.perf_counter()
        self.model = L.llama_model_load_from_file(str(gguf_path).encode(), mp)
        if not self.model:
            raise SystemExit(f"error: llama.cpp could not load {gguf_path} (rerun with --verbose)")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = n_batch
        cp.n_seq_max = 1
        cp.n_threads = n_threads
        cp.n_threads_batch = n_threads
        cp.no_perf = True
        cp.type_k = self.CACHE_TYPES[cache_type]
        cp.type_v = self.CACHE_TYPES[cache_type]
        cp.flash_attn_type = self.FLASH_ATTN[flash_attn]
        self.cache_type = cache_type
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise SystemExit("error: llama_init_from_model failed (rerun with --verbose)")
        self.load_s = time.perf_counter() - t0
        self.flash_attn_type = int(cp.flash_attn_type)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        self.n_batch = n_batch
        self.batch = L.llama_batch_init(n_batch, 0, 1)
        self.mem = L.llama_get_memory(self.ctx)

    def info(self) -> dict:
        L = self.L
        return {"n_params": int(L.llama_model_n_params(self.model)),
                "model_bytes": int(L.llama_model_size(self.model)),
                "n_vocab": self.n_vocab,
                "load_s": self.load_s,
                "flash_attn_type": self.flash_attn_type,
                "cache_type": self.cache_type,
                "system_info": L.llama_print_system_info().decode(errors="replace").strip()}

    def clear(self):
        self.L.llama_memory_clear(self.mem, True)

    def decode(self, ids, pos0: int, all_logits: bool):
        b = self.batch
        n = len(ids)
        assert n <= self.n_batch
        b.n_tokens = n
        for i, t in enumerate(ids):
            b.token[i] = int(t)
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if (all_logits or i == n - 1) else 0
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        self.L.llama_synchronize(self.ctx)

    def logits_last(self) -> np.ndarray:
        p = self.L.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(p, shape=(self.n_vocab,))

    def logits_all(self, n: int) -> np.ndarray:
        p = self.L.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(p, shape=(n, self.n_vocab)).copy()

    # ---- benchmark tests ----
    def run_pp(self, ids) -> float:
        self.clear()
        t0 = time.perf_counter_ns()
        for s in range(0, len(ids), self.n_batch):
            self.decode(ids[s:s + self.n_batch], s, all_logits=False)
        return time.perf_counter_ns() - t0

    def run_tg(self, first: int, n: int) -> float:
        self.clear()
        tok = first
        t0 = time.perf_counter_ns()
        for i in range(n):
            self.decode([tok], i, all_logits=False)
            tok = int(self.logits_last().argmax())
        return time.perf_counter_ns() - t0

    # ---- teacher-forced logits ----
    def tf_prefill(self, ids) -> np.ndarray:
        self.clear()
        self.decode(ids, 0, all_logits=True)
        return self.logits_all(len(ids))

    def tf_decode(self, ids) -> np.ndarray:
        self.clear()
        out = np.empty((len(ids), self.n_vocab), np.float32)
        for i, t in enumerate(ids):
            self.decode([t], i, all_logits=False)
            out[i] = self.logits_last()
        return out

    def greedy(self, prompt, n: int) -> list[int]:
        """Prefill `prompt`, then n argmax steps (the first generated token is the prefill's argmax)."""
        self.clear()
        self.decode(prompt, 0, all_logits=False)
        out = []
        tok = int(self.logits_last().argmax())
        for i in range(n):
            out.append(tok)
            if i + 1 < n:
                self.decode([tok], len(prompt) + i, all_logits=False)
                tok = int(self.logits_last().argmax())
        return out

    def close(self):
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)


def stats(samples_ns: list[int], n_tok: int) -> dict:
    ts = [n_tok / (s * 1e-9) for s in samples_ns]
    return {"samples_ns": samples_ns, "avg_ts": statistics.fmean(ts),
            "stddev_ts": statistics.stdev(ts) if len(ts) > 1 else 0.0}


# --------------------------------------------------------------------------------------------
# our engine
# --------------------------------------------------------------------------------------------

def find_k3(explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit)
    for c in (REPO / "build" / "bin" / "k3", REPO / "build-peer" / "bin" / "k3"):
        if c.is_file() and os.access(c, os.X_OK):
            return c
    return None


def k3_logits(k3: Path, ckpt: Path, ids, threads: int, extra: list[str]) -> np.ndarray:
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "logits.f32"
        cmd = [str(k3), "logits", "-m", str(ckpt), "--ids", ",".join(map(str, ids)), "-o", str(out),
               "-t", str(threads)] + extra
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-500:]}")
        a = np.fromfile(out, dtype="<f4")
    return a.reshape(len(ids), -1)


def k3_generate(k3: Path, ckpt: Path, ids, n: int, threads: int, extra: list[str]) -> list[int]:
    cmd = [str(k3), "generate", "-m", str(ckpt), "--ids", ",".join(map(str, ids)), "-n", str(n),
           "--print-ids", "-t", str(threads)] + extra
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    return [int(x) for x in r.stdout.replace(",", " ").split()][-n:]


def k3_bench(k3: Path, ckpt: Path, pp: int, tg: int, reps: int, threads: int, seed: int,
             extra: list[str]) -> dict:
    cmd = [str(k3), "bench", "-m", str(ckpt), "-p", str(pp), "-n", str(tg), "-r", str(reps),
           "-t", str(threads), "--seed", str(seed), "-o", "json", "--no-progress"] + extra
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    doc = json.loads(r.stdout)
    doc["command"] = " ".join(cmd)
    return doc


def compare(peer: np.ndarray, ref: np.ndarray) -> dict:
    a = peer.astype(np.float64)
    b = ref.astype(np.float64)
    if a.shape != b.shape:
        return {"error": f"shape mismatch {a.shape} vs {b.shape}"}
    d = a - b
    per_pos = np.linalg.norm(d, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-30)
    am_a, am_b = a.argmax(1), b.argmax(1)
    top2 = np.sort(b, axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    agree = am_a == am_b
    return {"rel_l2": float(np.linalg.norm(d) / np.linalg.norm(b)),
            "rel_l2_median_pos": float(np.median(per_pos)),
            "rel_l2_max_pos": float(per_pos.max()),
            "max_abs": float(np.abs(d).max()),
            "argmax_agree": int(agree.sum()), "n": int(len(agree)),
            "disagree_positions": [int(i) for i in np.nonzero(~agree)[0]],
            "ref_top2_margin_at_disagreements": [float(margin[i]) for i in np.nonzero(~agree)[0]]}


# --------------------------------------------------------------------------------------------

def parse_ids(s: str) -> list[int]:
    if s.startswith("@"):
        s = Path(s[1:]).read_text()
    return [int(x) for x in s.replace(",", " ").split()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("ckpt", help="checkpoint directory (released K3 layout, or kimi_linear)")
    ap.add_argument("-p", "--pp", type=int, default=128, help="prefill length N of ppN (0 = skip; default 128)")
    ap.add_argument("-n", "--tg", type=int, default=32, help="decode length N of tgN (0 = skip; default 32)")
    ap.add_argument("-r", "--reps", type=int, default=3, help="timed repetitions per test (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up runs per test (default 1)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads (default 2)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the random ids (default 1)")
    ap.add_argument("--with-k3", action="store_true", help="also run `k3 bench` with the same settings")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --with-k3: alternate the two engines this many rounds (llama.cpp first in odd "
                         "rounds, k3 first in even ones) and report the median of the per-round ratios; a "
                         "shared machine's memory bandwidth moves between the two engines' runs (default 1)")
    ap.add_argument("--no-bench", action="store_true", help="skip the throughput tests")
    ap.add_argument("--no-check", action="store_true", help="skip the logits cross-check")
    ap.add_argument("--check-ids", help="ids for the cross-check: 1,2,3 or @file (default: the "
                    "checkpoint's reference.json ids, else --check-n seeded random ids)")
    ap.add_argument("--check-n", type=int, default=32, help="number of random cross-check ids (default 32)")
    ap.add_argument("--greedy-n", type=int, default=0,
                    help="also decode this many greedy tokens after the cross-check ids with both engines "
                         "(llama.cpp; `k3 generate` with --k3-logits-args) and compare them (default 0 = skip)")
    ap.add_argument("--k3", help="our k3 binary (default build/bin/k3, then build-peer/bin/k3)")
    ap.add_argument("--k3-bench-args", default="", help="extra arguments for `k3 bench` (e.g. '--numerics exact')")
    ap.add_argument("--k3-logits-args", default="", help="extra arguments for `k3 logits`")
    ap.add_argument("--gguf", help="use this GGUF instead of converting")
    ap.add_argument("--outtype", default="bf16", help="converter outtype for non-expert tensors (default bf16)")
    ap.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="GGUF cache (default build/peer-gguf)")
    ap.add_argument("--reconvert", action="store_true", help="ignore the cached GGUF")
    ap.add_argument("--llama-src", default=str(DEFAULT_LLAMA_SRC), help="vendored llama.cpp sources")
    ap.add_argument("--json-out", help="also write the JSON document to this file")
    ap.add_argument("--cache-type", default="f16", choices=sorted(Peer.CACHE_TYPES),
                    help="llama.cpp K/V cache type (default f16, llama.cpp's default)")
    ap.add_argument("--flash-attn", default="auto", choices=sorted(Peer.FLASH_ATTN),
                    help="llama.cpp flash attention (default auto, llama.cpp's default)")
    ap.add_argument("--verbose", action="store_true", help="show llama.cpp's log")
    a = ap.parse_args()

    ckpt = Path(a.ckpt).resolve()
    cfg = json.loads((ckpt / "config.json").read_text())
    vocab = int(cfg.get("text_config", cfg)["vocab_size"])
    rng = np.random.default_rng(a.seed)

    ref_json = ckpt / "reference.json"
    ref_doc = json.loads(ref_json.read_text()) if ref_json.is_file() else None
    if a.check_ids:
        check_ids = parse_ids(a.check_ids)
    elif ref_doc and "ids" in ref_doc:
        check_ids = [int(x) for x in ref_doc["ids"]]
    else:
        check_ids = [int(x) for x in rng.integers(0, vocab, a.check_n)]

    gguf_path, converted, conv_s = ensure_gguf(a)
    import llama_cpp
    doc: dict = {
        "peer": {"engine": "llama.cpp (vendored by llama-cpp-python)",
                 "llama_cpp_python": getattr(llama_cpp, "__version__", "?"),
                 "llama_cpp_commit": llama_src_commit(Path(a.llama_src)),
                 "python": platform.python_version()},
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": {**host_info(), "loadavg_start": list(os.getloadavg())},
        "command": os.environ.get("PEER_COMMAND") or " ".join(shlex.quote(x) for x in sys.argv),
        "model_type": cfg.get("model_type"),
        "checkpoint": str(ckpt),
        "gguf": {"path": str(gguf_path), "bytes": gguf_path.stat().st_size, "converted_now": converted,
                 "convert_s": conv_s, **gguf_summary(gguf_path, Path(a.llama_src))},
        "settings": {"threads": a.threads, "n_prompt": a.pp, "n_gen": a.tg, "repetitions": a.reps, "rounds": a.rounds,
                     "warmup_runs": a.warmup, "seed": a.seed, "n_depth": 0, "outtype": a.outtype},
    }

    n_batch = max(a.pp, len(check_ids), 1)
    n_ctx = max(a.pp, a.tg, len(check_ids)) + 16
    n_ctx = (n_ctx + 255) // 256 * 256
    peer = Peer(gguf_path, a.threads, n_ctx, n_batch, a.verbose, a.cache_type, a.flash_attn)
    doc["peer"].update(peer.info())
    doc["settings"].update({"n_ctx": n_ctx, "n_batch": n_batch, "n_ubatch": n_batch})

    pp_ids = [int(x) for x in rng.integers(0, peer.n_vocab, a.pp)] if a.pp > 0 else []
    tg_first = int(rng.integers(0, peer.n_vocab)) if a.tg > 0 else 0

    def peer_round() -> list[dict]:
        out = []
        if a.pp > 0:
            for _ in range(a.warmup):
                peer.run_pp(pp_ids)
            s = [peer.run_pp(pp_ids) for _ in range(a.reps)]
            out.append({"test": f"pp{a.pp}", "n_prompt": a.pp, "n_gen": 0, **stats(s, a.pp)})
        if a.tg > 0:
            for _ in range(a.warmup):
                peer.run_tg(tg_first, a.tg)
            s = [peer.run_tg(tg_first, a.tg) for _ in range(a.reps)]
            out.append({"test": f"tg{a.tg}", "n_prompt": 0, "n_gen": a.tg, **stats(s, a.tg)})
        return out

    k3 = find_k3(a.k3)

    def k3_round() -> dict:
        kb = k3_bench(k3, ckpt, a.pp, a.tg, a.reps, a.threads, a.seed, shlex.split(a.k3_bench_args))
        return {"command": kb["command"], "build": kb.get("build"), "settings": kb.get("settings"),
                "results": [{k: r[k] for k in ("test", "n_prompt", "n_gen", "samples_ns", "avg_ts", "stddev_ts",
                                                "roofline") if k in r} for r in kb.get("results", [])]}

    results = []
    if not a.no_bench:
        with_k3 = a.with_k3 and k3 is not None
        if a.with_k3 and k3 is None:
            doc["k3"] = {"error": "k3 binary not found (build/bin/k3, build-peer/bin/k3)"}
        rounds = []
        for i in range(max(1, a.rounds) if with_k3 else 1):
            r: dict = {"round": i + 1, "order": "llama.cpp, k3" if i % 2 == 0 else "k3, llama.cpp",
                       "loadavg_start": list(os.getloadavg())}
            if i % 2 == 0:
                r["llama_cpp"] = peer_round()
            if with_k3:
                try:
                    r["k3"] = k3_round()
                except Exception as e:  # reported; the rounds stop with llama.cpp's numbers alone
                    doc["k3"] = {"error": str(e)}
                    with_k3 = False
            if i % 2 == 1:
                r["llama_cpp"] = peer_round()
            if "k3" in r:
                theirs = {x["test"]: x["avg_ts"] for x in r["llama_cpp"]}
                r["k3_over_llama_cpp"] = {x["test"]: x["avg_ts"] / theirs[x["test"]] for x in r["k3"]["results"]
                                          if x["test"] in theirs}
                # llama.cpp against the roof k3 bench probed in the same round (same work per token:
                # both engines read the same weights in the same formats), for scale.
                r["llama_cpp_roofline_ratio_vs_k3_probes"] = {
                    x["test"]: theirs[x["test"]] * x["roofline"]["ratio"] / x["avg_ts"]
                    for x in r["k3"]["results"] if x["test"] in theirs and "roofline" in x}
            rounds.append(r)
            if not with_k3 and a.with_k3:
                break
        # All rounds' samples pooled per engine and test (the round-1 layout when --rounds 1).
        def pooled(per_round: list[list[dict]]) -> list[dict]:
            out = []
            for first in per_round[0]:
                s = [x for rr in per_round for t in rr if t["test"] == first["test"] for x in t["samples_ns"]]
                n = first["n_prompt"] + first["n_gen"]
                out.append({k: first[k] for k in ("test", "n_prompt", "n_gen")} | stats(s, n))
            return out
        results = pooled([r["llama_cpp"] for r in rounds])
        if all("k3" in r for r in rounds) and with_k3:
            doc["k3"] = {k: rounds[0]["k3"][k] for k in ("command", "build", "settings")}
            doc["k3"]["results"] = pooled([r["k3"]["results"] for r in rounds])
            doc["k3_over_llama_cpp_median"] = {
                t: statistics.median(r["k3_over_llama_cpp"][t] for r in rounds) for t in rounds[0]["k3_over_llama_cpp"]}
        if len(rounds) > 1:
            doc["rounds"] = rounds
        if rounds and with_k3 and all("k3" in r for r in rounds):
            doc["summary"] = summarize(rounds)
    doc["results"] = results

    if not a.no_check:
        chk: dict = {"ids": check_ids}
        lp = peer.tf_prefill(check_ids)
        ld = peer.tf_decode(check_ids)
        chk["peer_prefill_vs_peer_decode"] = compare(ld, lp)
        if k3 is None:
            chk["error"] = "k3 binary not found (build/bin/k3, build-peer/bin/k3)"
        else:
            try:
                ours = k3_logits(k3, ckpt, check_ids, a.threads, shlex.split(a.k3_logits_args))
                chk["k3_binary"] = str(k3)
                chk["k3_logits_args"] = a.k3_logits_args
                chk["peer_prefill_vs_k3"] = compare(lp, ours)
                chk["peer_decode_vs_k3"] = compare(ld, ours)
                if a.greedy_n > 0:
                    g_peer = peer.greedy(check_ids, a.greedy_n)
                    g_k3 = k3_generate(k3, ckpt, check_ids, a.greedy_n, a.threads, shlex.split(a.k3_logits_args))
                    div = next((i for i, (x, y) in enumerate(zip(g_peer, g_k3)) if x != y), None)
                    chk["greedy"] = {"n": a.greedy_n, "llama_cpp": g_peer, "k3": g_k3,
                                     "identical": g_peer == g_k3, "first_divergence": div}
            except Exception as e:
                chk["error"] = str(e)
                ours = None
        if ref_doc and (ckpt / ref_doc.get("logits_file", "logits.f32")).is_file() and \
                [int(x) for x in ref_doc["ids"]] == check_ids:
            ref = np.fromfile(ckpt / ref_doc.get("logits_file", "logits.f32"), dtype="<f4")
            ref = ref.reshape(len(check_ids), -1)
            chk["peer_prefill_vs_fp64_reference"] = compare(lp, ref)
            if ours is not None:
                chk["k3_vs_fp64_reference"] = compare(ours, ref)
        doc["check"] = chk

    peer.close()
    doc["host"]["loadavg_end"] = list(os.getloadavg())

    # human summary on stderr
    eprint(f"\nllama.cpp (llama-cpp-python {doc['peer']['llama_cpp_python']}) on {ckpt.name}, "
           f"{a.threads} threads, GGUF {gguf_path.name} ({doc['gguf'].get('tensor_types')})")
    eprint(f"| engine    | test   | t/s              |")
    eprint(f"|-----------|--------|------------------|")
    for r in results:
        eprint(f"| llama.cpp | {r['test']:6} | {r['avg_ts']:8.2f} ± {r['stddev_ts']:6.2f} |")
    for r in doc.get("k3", {}).get("results", []):
        eprint(f"| k3        | {r['test']:6} | {r['avg_ts']:8.2f} ± {r['stddev_ts']:6.2f} |")
    if "k3" in doc and "error" in doc["k3"]:
        eprint(f"k3 bench: {doc['k3']['error']}")
    for t in (doc.get("rounds") or [{}])[0].get("llama_cpp_roofline_ratio_vs_k3_probes", {}):
        ours = statistics.median(x["roofline"]["ratio"] for r in doc["rounds"] for x in r["k3"]["results"]
                                 if x["test"] == t)
        theirs = statistics.median(r["llama_cpp_roofline_ratio_vs_k3_probes"][t] for r in doc["rounds"])
        eprint(f"{t} vs the roof k3 bench probed in each round (median): k3 {100 * ours:.1f}%, "
               f"llama.cpp {100 * theirs:.1f}%")
    for t, v in doc.get("k3_over_llama_cpp_median", {}).items():
        per = ", ".join(f"{r['k3_over_llama_cpp'][t]:.2f}" for r in doc.get("rounds", []))
        eprint(f"k3 / llama.cpp {t}: {v:.2f}x" + (f" (median of {len(doc['rounds'])} rounds: {per})" if per else ""))
    for k, v in doc.get("check", {}).items():
        if isinstance(v, dict) and "rel_l2" in v:
            eprint(f"{k}: rel-L2 {v['rel_l2']:.3e} (per position: median {v['rel_l2_median_pos']:.2e}, "
                   f"max {v['rel_l2_max_pos']:.2e}), max|d| {v['max_abs']:.3e}, "
                   f"argmax {v['argmax_agree']}/{v['n']}")
    if "greedy" in doc.get("check", {}):
        g = doc["check"]["greedy"]
        eprint(f"greedy {g['n']} tokens: " + ("identical" if g["identical"] else
                                              f"first divergence at {g['first_divergence']}"))
    if "error" in doc.get("check", {}):
        eprint(f"check: {doc['check']['error']}")

    text = json.dumps(doc, indent=2)
    print(text)
    if a.json_out:
        Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json_out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
