#!/usr/bin/env python3
"""Generate the committed Kimi Linear fixture tests/fixtures/kl-tiny/ (seed 1, bf16).

Writes the checkpoint (tools/gen/gen_kimi_linear.py --preset kl-tiny: config.json, 2 shards,
model.safetensors.index.json) plus
  reference.json  ids, tf_argmax, tf_top2_margin, greedy {prompt, n, ids, margins}, the agreement
                  of our float64 reference (tools/reference/kimi_linear_reference.py) with
                  transformers, the transformers version and code path, diagnostics
  logits.f32      float32 little-endian, row-major [len(ids), vocab]: logits of ONE full
                  teacher-forced pass of transformers' KimiLinearForCausalLM (fp32, CPU, no cache)
  README.md

The ids are the first seeded 24-token candidate whose top1-top2 logit margin is >= 1e-3 at every
position (in both transformers fp32 and the float64 reference, with identical argmax) and whose
router selection gap (k-th vs (k+1)-th biased score) is >= 1e-4 for every token and MoE layer. The
greedy prompt is the first seeded 8-token candidate whose 12-step greedy continuation is identical
in transformers (its own cache: chunked prefill + recurrent single-token KDA steps) and in the
float64 reference (cached), with margins >= 0.01 and router gaps >= 1e-4 at every step.

Usage:
  python tools/gen/make_kl_fixtures.py                 # writes tests/fixtures/kl-tiny
  python tools/gen/make_kl_fixtures.py --out-root DIR  # writes DIR/kl-tiny
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tools", "reference"))
import gen_kimi_linear as G  # noqa: E402
from make_fixtures import dumps  # noqa: E402  (one key per line, scalar lists on one line)
import kimi_linear_reference as R  # noqa: E402

COMMITTED = {"kl-tiny": 1}
DTYPE = "bf16"
N_IDS, N_PROMPT, GREEDY_N = 24, 8, 12
MIN_TF_MARGIN = 1e-3
MIN_GREEDY_MARGIN = 0.01
MIN_ROUTER_GAP = 1e-4


def sig(x: float, digits: int = 6) -> float:
    if x == 0 or not np.isfinite(x):
        return float(x)
    return float(f"{x:.{digits - 1}e}")


def margins(logits: torch.Tensor) -> torch.Tensor:
    top = torch.topk(logits, 2, dim=-1).values
    return top[..., 0] - top[..., 1]


def make_fixture(preset: str, seed: int, out: str) -> dict:
    G.write_checkpoint(out, preset, seed, DTYPE)
    for fn in ("reference.json", "logits.f32", "README.md"):
        if os.path.exists(os.path.join(out, fn)):
            os.remove(os.path.join(out, fn))
    cfg, w = R.load_checkpoint(out)
    vocab = cfg["vocab_size"]
    ref = R.KimiLinearRef(cfg, w)
    model, tf_version = R.load_transformers(out)

    # ---- teacher-forced ids
    chosen = None
    for attempt in range(64):
        rng = np.random.default_rng([seed, 0x1D5, attempt])
        ids = [int(x) for x in rng.integers(0, vocab, size=N_IDS)]
        ref.diag = ref._fresh_diag()
        own = ref.forward(ids)
        if float(margins(own).min()) < MIN_TF_MARGIN or ref.diag["router_min_selection_gap"] < MIN_ROUTER_GAP:
            continue
        tf = R.transformers_logits(model, ids)
        if float(margins(tf).min()) < MIN_TF_MARGIN or not torch.equal(tf.argmax(-1), own.argmax(-1)):
            continue
        chosen = (attempt, ids, own, tf, dict(ref.diag))
        break
    if chosen is None:
        raise SystemExit(f"{preset}: no candidate id sequence without near-ties")
    attempt, ids, own, tf, diag = chosen
    if diag["bias_changed_selection_tokens"] <= 0:
        raise SystemExit(f"{preset}: the correction bias never changes a top-k selection")
    tf32 = tf.to(torch.float32)
    with open(os.path.join(out, "logits.f32"), "wb") as f:
        f.write(tf32.numpy().astype("<f4").tobytes(order="C"))

    # own reference: incremental (token by token, cached) vs the full pass
    st = ref.new_state()
    inc = torch.cat([ref.forward([t], st) for t in ids], 0)
    inc_diff = float((inc - own).abs().max())
    # sensitivity: vLLM's kv_a_layernorm eps (rms_norm_eps) instead of 1e-6
    saved = R.KV_NORM_EPS
    R.KV_NORM_EPS = cfg["rms_norm_eps"]
    try:
        own_vllm_eps = ref.forward(ids)
    finally:
        R.KV_NORM_EPS = saved

    # ---- greedy prompt
    g_chosen = None
    rng = np.random.default_rng([seed, 0x6EED])
    for g_attempt in range(32):
        prompt = [int(x) for x in rng.integers(0, vocab, size=N_PROMPT)]
        ref.diag = ref._fresh_diag()
        own_ids, own_m = ref.greedy(prompt, GREEDY_N)
        gap = ref.diag["router_min_selection_gap"]
        if own_m < MIN_GREEDY_MARGIN or gap < MIN_ROUTER_GAP:
            continue
        tf_ids, tf_scores = R.transformers_greedy(model, prompt, GREEDY_N)
        tf_m = min(float(margins(s)) for s in tf_scores)
        if tf_ids != own_ids or tf_m < MIN_GREEDY_MARGIN:
            continue
        # the cached transformers steps vs a full float64 pass over prompt + continuation
        full = ref.forward(prompt + own_ids)[len(prompt) - 1: len(prompt) - 1 + GREEDY_N]
        step_rel = R.rel_l2(torch.stack(tf_scores), full)
        g_chosen = (g_attempt, prompt, own_ids, own_m, tf_m, gap, step_rel)
        break
    if g_chosen is None:
        raise SystemExit(f"{preset}: no greedy prompt without near-ties")
    g_attempt, prompt, g_ids, own_m, tf_m, gap, step_rel = g_chosen

    la = cfg["linear_attn_config"]
    refj = {
        "preset": preset,
        "seed": seed,
        "weights_dtype": DTYPE,
        "vocab_size": vocab,
        "layer_kinds": ref.kind,
        "mla_kv_norm_eps": R.KV_NORM_EPS,
        "kda_o_norm_eps": cfg["rms_norm_eps"],
        "ids": ids,
        "logits_file": "logits.f32",
        "logits_dtype": "float32-le",
        "logits_shape": [len(ids), vocab],
        "logits_source": "transformers KimiLinearForCausalLM, fp32, CPU, one full pass, use_cache=False",
        "tf_argmax": [int(x) for x in tf.argmax(-1).tolist()],
        "tf_top2_margin": [sig(float(x), 4) for x in margins(tf)],
        "greedy": {"prompt": prompt, "n": GREEDY_N, "ids": g_ids,
                   "min_top2_margin": sig(min(own_m, tf_m), 4),
                   "router_min_selection_gap": sig(gap, 4),
                   "source": "transformers generate (own cache: chunked prefill, recurrent decode) == "
                             "float64 reference cached greedy"},
        "agreement": {
            "own_float64_vs_transformers_fp32_rel_l2": sig(R.rel_l2(tf, own), 3),
            "own_float64_vs_transformers_fp32_max_abs": sig(float((tf - own).abs().max()), 3),
            "own_float64_vs_transformers_fp32_argmax_equal": bool(torch.equal(tf.argmax(-1), own.argmax(-1))),
            "greedy_steps_transformers_cached_vs_own_full_rel_l2": sig(step_rel, 3),
            "own_incremental_vs_full_max_abs": sig(inc_diff, 2),
            "own_with_kv_norm_eps_rms_norm_eps_vs_transformers_rel_l2": sig(R.rel_l2(tf, own_vllm_eps), 3),
            "note": "own = tools/reference/kimi_linear_reference.py (float64); the last entry shows how far "
                    "vLLM's kv_a_layernorm eps (rms_norm_eps) would move the logits on this fixture",
        },
        "transformers": {"version": tf_version, "dtype": "float32", "device": "cpu",
                         **R.transformers_path_report()},
        "diagnostics": {
            "ids_attempt": attempt,
            "greedy_attempt": g_attempt,
            "tf_min_top2_margin": sig(float(margins(tf).min()), 4),
            "router_min_selection_gap": sig(diag["router_min_selection_gap"], 4),
            "bias_changed_selection_tokens": diag["bias_changed_selection_tokens"],
            "layers_with_bias_changed_selection": sorted(diag["layers_with_bias_changed_selection"]),
            "kda_decay_range": [sig(diag["kda_min_decay"], 4), sig(diag["kda_max_decay"], 4)],
            "kda_heads_x_dim": [la["num_heads"], la["head_dim"]],
            "note": "computed over `ids` by the float64 reference; bias_changed counts (token, layer) pairs "
                    "whose top-k set differs from the top-k of the unbiased sigmoid scores",
        },
    }
    with open(os.path.join(out, "reference.json"), "w") as f:
        f.write(dumps(refj) + "\n")
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(README.format(preset=preset, seed=seed, n=len(ids), vocab=vocab, ver=tf_version,
                              kinds=", ".join(f"{i}:{k}" for i, k in enumerate(ref.kind)),
                              full=la["full_attn_layers"], kda=la["kda_layers"]))
    return refj


README = """# tests/fixtures/{preset} (generated, do not edit)

Written by `python tools/gen/make_kl_fixtures.py` (preset {preset}, seed {seed}, bf16 weights; needs the
transformers pin of tools/reference/requirements-kimi-linear.txt); check with
`python tools/gen/check_kl_fixture.py`. Random weights in the released **Kimi Linear** checkpoint layout
(Moonshot's `moonshotai/Kimi-Linear-48B-A3B-Instruct` names, flat config, see docs/kimi-linear.md).

- checkpoint: `config.json` + `model.safetensors.index.json` + 2 shards. Layers (0-based):
  {kinds}; `full_attn_layers` {full} / `kda_layers` {kda} (1-indexed); layer 0 has the dense MLP,
  the others `block_sparse_moe` (8 experts, top-3, 1 shared). BF16 except `A_log`, `dt_bias`,
  router `gate.weight` and `gate.e_score_correction_bias` (F32). Vocab {vocab}, no tokenizer (ids only).
- `logits.f32`: float32 little-endian, row-major [{n}, {vocab}] = logits of one full pass of
  transformers {ver} `KimiLinearForCausalLM` (fp32, CPU, `use_cache=False`; pure-torch fallbacks
  `chunk_kda` / `causal_conv1d_fn`, eager attention) over `reference.json["ids"]`.
- `reference.json`: `ids`, `tf_argmax`, `tf_top2_margin` (all >= 1e-3), `greedy` {{`prompt`, `n`, `ids`}}
  (transformers' cached greedy == the float64 reference's), `mla_kv_norm_eps` (1e-6) and
  `kda_o_norm_eps`, `agreement` (float64 reference vs transformers: rel-L2 of the logits, greedy steps,
  incremental == full), `transformers` (version, code path), `diagnostics`.
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-root", default=os.path.join(REPO, "tests", "fixtures"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # fixed reduction order
    for preset, seed in COMMITTED.items():
        out = os.path.join(a.out_root, preset)
        r = make_fixture(preset, seed, out)
        total = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
        ag = r["agreement"]
        print(f"{preset}: {out} ({total} bytes); rel-L2 own f64 vs transformers fp32 "
              f"{ag['own_float64_vs_transformers_fp32_rel_l2']}; greedy {r['greedy']['prompt']} -> "
              f"{r['greedy']['ids']}; min tf margin {min(r['tf_top2_margin'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
