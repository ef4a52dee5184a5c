#!/usr/bin/env python3
"""The committed Kimi Linear fixture (tests/fixtures/kl-tiny) against our float64 reference.

1. tools/reference/kimi_linear_reference.py reproduces logits.f32 (transformers' fp32 pass) to
   rel-L2 < 1e-5 with identical argmax, its cached greedy decode gives reference.json's greedy ids,
   and its incremental (token by token) pass equals its full pass.
2. Each deliberate mistake of KimiLinearRef.VARIANTS (the traps of docs/kimi-linear.md §4) moves the
   logits by rel-L2 > 1e-2, i.e. far beyond the engine tolerance (1e-4): the fixture catches it.
   Reading the 1-indexed layer lists as 0-based is not a variant: it puts MLA where the checkpoint has
   KDA tensors, so an engine fails to bind (loud, not silent).
   (kv_a_layernorm eps 1e-5 vs 1e-6 is NOT caught: reference.json's agreement block records how
   little it moves the logits.)

Needs only numpy/safetensors/torch (not transformers). Run: python tests/python/test_kl_fixture.py
(or pytest tests/python).
"""
import json
import os
import sys

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools", "reference"))
import kimi_linear_reference as R  # noqa: E402

FX = os.path.join(REPO, "tests", "fixtures", "kl-tiny")
MIN_EFFECT = 1e-2


def load():
    with open(os.path.join(FX, "reference.json")) as f:
        ref = json.load(f)
    lg = np.fromfile(os.path.join(FX, ref["logits_file"]), dtype="<f4").reshape(ref["logits_shape"])
    cfg, w = R.load_checkpoint(FX)
    return ref, torch.from_numpy(lg.astype(np.float64)), cfg, w


def test_reference_reproduces_fixture():
    ref, lg, cfg, w = load()
    m = R.KimiLinearRef(cfg, w)
    own = m.forward(ref["ids"])
    rel = R.rel_l2(own, lg)
    assert rel < 1e-5, rel
    assert own.argmax(-1).tolist() == ref["tf_argmax"]
    g = ref["greedy"]
    ids, _ = m.greedy(g["prompt"], g["n"])
    assert ids == g["ids"], (ids, g["ids"])
    st = m.new_state()
    inc = torch.cat([m.forward([t], st) for t in ref["ids"]], 0)
    assert float((inc - own).abs().max()) < 1e-10


def test_traps_are_caught():
    ref, lg, cfg, w = load()
    weak = []
    for v in R.KimiLinearRef.VARIANTS:
        rel = R.rel_l2(R.KimiLinearRef(cfg, w, variant={v}).forward(ref["ids"]), lg)
        print(f"  {v:36s} rel-L2 {rel:.3e}")
        if not rel > MIN_EFFECT:
            weak.append((v, rel))
    assert not weak, weak


if __name__ == "__main__":
    test_reference_reproduces_fixture()
    test_traps_are_caught()
    print("OK")
