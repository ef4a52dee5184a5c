#!/usr/bin/env python3
"""Generate the committed tiny-checkpoint fixtures: tests/fixtures/<preset>/.

For each committed preset (tiny: seed 1, tiny-flat: seed 2) it writes the checkpoint files
(config.json, safetensors, index) plus
  reference.json  metadata, token ids, greedy continuation, diagnostics (see below)
  logits.f32      float32 little-endian, row-major [len(ids), vocab]: logits of ONE full
                  teacher-forced float64 reference pass over reference.json["ids"]

reference.json keys:
  preset, seed, vocab_size, mla_lora_norm_eps (1e-6, what the logits were computed with),
  ids (24), logits_file, logits_shape [24, vocab], tf_argmax (argmax per position),
  tf_top2_margin (top1 - top2 logit per position, rounded), greedy {prompt (8), n (12), ids (12),
  min_top2_margin}, diagnostics {summary..., per_layer: [...]}.
The greedy prompt is the first of a deterministic series of candidate prompts whose greedy run
keeps a top1-top2 margin >= 0.01 and a router selection gap >= 1e-4 at every step; the ids are
likewise the first seeded candidate with margins >= 1e-3 / 1e-4 (so fp32 engines agree on argmax
and expert choice).

Usage:
  python tools/gen/make_fixtures.py                 # writes tests/fixtures/tiny and tiny-flat
  python tools/gen/make_fixtures.py --out-root DIR  # writes DIR/tiny, DIR/tiny-flat
  python tools/gen/make_fixtures.py --preset tiny
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_tiny_checkpoint as G  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
COMMITTED = {"tiny": 1, "tiny-flat": 2, "tiny-chat": 3}
GREEDY_N = 12
MIN_GREEDY_MARGIN = 0.01


def sig(x: float, digits: int = 6) -> float:
    """Round to `digits` significant digits (keeps reference.json stable across BLAS builds)."""
    if x == 0 or not np.isfinite(x):
        return float(x)
    return float(f"{x:.{digits - 1}e}")


def margins(logits: torch.Tensor) -> torch.Tensor:
    top = torch.topk(logits, 2, dim=-1).values
    return top[..., 0] - top[..., 1]


def greedy_with_margin(m, prompt, n):
    """Greedy tokens (full recompute each) + the smallest logit top-2 margin and router gap seen."""
    seq = list(prompt)
    out, mmin, gmin = [], float("inf"), float("inf")
    for _ in range(n):
        diags: list = []
        lg = m.forward(seq, diagnostics=diags)[-1]
        t = int(torch.argmax(lg))
        mmin = min(mmin, float(margins(lg)))
        gmin = min([gmin] + [d["router_min_selection_gap"] for d in diags if d["ffn"] == "moe"])
        out.append(t)
        seq.append(t)
    return out, mmin, gmin


def dumps(obj, indent=0) -> str:
    """JSON with one key per line but lists of scalars on a single line."""
    pad = " " * indent
    if isinstance(obj, dict):
        items = [f'{pad} {json.dumps(k)}: {dumps(v, indent + 1).lstrip()}' for k, v in obj.items()]
        return pad + "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and any(isinstance(x, (dict, list)) for x in obj):
        return pad + "[\n" + ",\n".join(dumps(x, indent + 1) for x in obj) + "\n" + pad + "]"
    return pad + json.dumps(obj)


def make_fixture(preset: str, seed: int, out: str) -> dict:
    G.write_checkpoint(out, preset, seed)
    vocab = G.PRESETS[preset]["vocab"]
    m, ids, prompt, logits, diags, summary, ok = G.verify(out, seed, vocab)
    if not ok:
        raise SystemExit(f"{preset}: generated checkpoint does not meet the fixture conditions")
    lg32 = logits.to(torch.float32).numpy().astype("<f4")
    with open(os.path.join(out, "logits.f32"), "wb") as f:
        f.write(lg32.tobytes(order="C"))
    # greedy: the first candidate prompt without near-ties at every step
    rng = np.random.default_rng([seed, 0x6EED])
    chosen = None
    for attempt in range(32):
        cand = prompt if attempt == 0 else [int(x) for x in rng.integers(0, vocab, size=8)]
        toks, mmin, gmin = greedy_with_margin(m, cand, GREEDY_N)
        if mmin >= MIN_GREEDY_MARGIN and gmin >= G.MIN_ROUTER_GAP:
            chosen = (cand, toks, mmin, gmin)
            break
    if chosen is None:
        raise SystemExit(f"{preset}: no greedy prompt without near-ties")
    per_layer = []
    for d in diags:
        e = {"layer": d["layer"], "attn": d["type"], "ffn": d["ffn"], "num_snapshots": d["num_snapshots"],
             "max_abs_partial_sum": sig(d["max_abs_P"])}
        if d["ffn"] == "moe":
            e.update(routed_gate_absmax=sig(d["routed_gate_absmax"]), routed_up_absmax=sig(d["routed_up_absmax"]),
                     routed_both_saturated=d["routed_both_saturated"],
                     bias_changed_selection_tokens=d["bias_changed_selection_tokens"])
        per_layer.append(e)
    diag = {k: (sig(v) if isinstance(v, float) else v) for k, v in summary.items()}
    diag["note"] = ("computed over `ids` (one teacher-forced pass); 'both_saturated' counts routed SiTU "
                    "input elements with |gate| > 3*beta1 and |up| > 3*beta2; bias_changed counts tokens "
                    "whose top-k set differs from the top-k of the unbiased sigmoid scores")
    diag["per_layer"] = per_layer
    ref = {
        "preset": preset,
        "seed": seed,
        "vocab_size": vocab,
        "mla_lora_norm_eps": m.mla_lora_norm_eps,
        "ids": ids,
        "logits_file": "logits.f32",
        "logits_dtype": "float32-le",
        "logits_shape": [len(ids), vocab],
        "tf_argmax": [int(x) for x in logits.argmax(-1).tolist()],
        "tf_top2_margin": [sig(float(x), 4) for x in margins(logits)],
        "greedy": {"prompt": chosen[0], "n": GREEDY_N, "ids": chosen[1], "min_top2_margin": sig(chosen[2], 4),
                   "router_min_selection_gap": sig(chosen[3], 4)},
        "diagnostics": diag,
    }
    with open(os.path.join(out, "reference.json"), "w") as f:
        f.write(dumps(ref) + "\n")
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(FIXTURE_README.format(preset=preset, seed=seed, n=len(ids), vocab=vocab))
        if "tokenizer_dir" in G.PRESETS[preset]:
            f.write(TOKENIZER_NOTE.format(src=G.PRESETS[preset]["tokenizer_dir"]))
    return ref


TOKENIZER_NOTE = """
Also holds the model's tokenizer (`tiktoken.model`, `tokenizer_config.json`: copies of
`{src}`) and a `generation_config.json`, as a released checkpoint does, so text-level
commands (`k3 run`, `k3 chat`, `k3 bench`) can be tested on it.
"""

FIXTURE_README = """# tests/fixtures/{preset} (generated, do not edit)

Written by `python tools/gen/make_fixtures.py --preset {preset}` (seed {seed}); check with
`python tools/gen/check_fixtures.py`. Random weights in the released Kimi K3 checkpoint layout.

- checkpoint: `config.json` + `model.safetensors` or `model.safetensors.index.json` + shards.
- `reference.json`: `ids` (teacher-forced sequence), `tf_argmax`, `tf_top2_margin`,
  `greedy` {{`prompt`, `n`, `ids`}}, `mla_lora_norm_eps`, `diagnostics`.
- `logits.f32`: float32 little-endian, row-major [{n}, {vocab}] = logits of one full causal
  float64 reference pass (tools/reference/k3_reference.py) over `ids`.
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-root", default=os.path.join(REPO, "tests", "fixtures"))
    ap.add_argument("--preset", choices=sorted(COMMITTED), action="append")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # fixed reduction order
    for preset in a.preset or sorted(COMMITTED):
        out = os.path.join(a.out_root, preset)
        ref = make_fixture(preset, COMMITTED[preset], out)
        total = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
        print(f"{preset}: {out} ({total} bytes); greedy prompt {ref['greedy']['prompt']} -> {ref['greedy']['ids']}; "
              f"min tf margin {min(ref['tf_top2_margin'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
