#!/usr/bin/env python3
"""Checks tools/train/k3_model.py against the fp64 reference's committed logits.

For each committed fixture (tests/fixtures/tiny, tiny-flat, tiny-chat: logits.f32 written by
tools/reference/k3_reference.py), loads the checkpoint into K3Model in float64 and compares all
teacher-forced logits (rel-L2), with chunked KDA (chunk 4 and 32) and the recurrent twin; also
checks kda_chunked == kda_recurrent on random inputs and that MXFP4 pack/quantize round-trips
the fixtures' real MXFP4 experts bit-exactly. Exit 1 on any failure.

    python tools/train/check_model.py
"""
import json
import os
import sys

import numpy as np
import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import k3_model as K  # noqa: E402

TOL = 1e-9  # float64 model vs float64 reference (as stored in float32 logits: ~1e-7 relative)


def load_dir(d):
    tensors = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(d, fn)))
    return tensors


def rel_l2(a, b):
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def main() -> int:
    ok = True
    torch.manual_seed(0)
    # chunked vs recurrent KDA on random inputs
    B, T, H, D = 2, 37, 3, 8
    q = torch.randn(B, T, H, D, dtype=torch.float64) * 0.3
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, D, dtype=torch.float64)
    g = -5 * torch.sigmoid(torch.randn(B, T, H, D, dtype=torch.float64))
    beta = torch.sigmoid(torch.randn(B, T, H, dtype=torch.float64))
    o_r, s_r = K.kda_recurrent(q, k, v, g, beta)
    for C in (1, 4, 16, 32):
        o_c, s_c = K.kda_chunked(q, k, v, g, beta, chunk=C)
        e = max(rel_l2(o_c.double(), o_r), rel_l2(s_c.double(), s_r))
        print(f"kda chunked({C}) vs recurrent: {e:.2e}")
        ok &= e < 1e-5  # chunked runs in float32
    # float32 at the decay extremes (every gate at the -5 bound, and at 0): finite values and
    # gradients, and agreement with the float64 recurrence
    for gval in (-5.0, -1e-4):
        g32 = torch.full((B, T, H, D), gval, dtype=torch.float32)
        qs, ks, vs, bs = (t.float().clone().requires_grad_(True) for t in (q, k, v, beta))
        o32, _ = K.kda_chunked(qs, ks, vs, g32, bs, chunk=32)
        o64, _ = K.kda_recurrent(q, k, v, g32.double(), beta)
        o32.square().sum().backward()
        finite = all(torch.isfinite(t.grad).all() for t in (qs, ks, vs, bs)) and bool(torch.isfinite(o32).all())
        e = rel_l2(o32.detach().double(), o64)
        print(f"kda chunked(32) float32, all gates {gval}: vs float64 recurrence {e:.2e}, finite grads {finite}")
        ok &= finite and e < 1e-5
    for name in ("tiny", "tiny-flat", "tiny-chat"):
        d = os.path.join(REPO, "tests", "fixtures", name)
        cfg = K.config_from_json(json.load(open(os.path.join(d, "config.json"))))
        ref = json.load(open(os.path.join(d, "reference.json")))
        V = cfg.vocab
        want = torch.from_numpy(np.fromfile(os.path.join(d, ref["logits_file"]), dtype="<f4").reshape(-1, V)).double()
        tensors = load_dir(d)
        if "lm_head.weight" in tensors:  # flat layout: model./lm_head. names
            tensors = {("language_model." + k_): t for k_, t in tensors.items()}
        m = K.K3Model(cfg).double()
        K.load_released(m, tensors)
        ids = torch.tensor([ref["ids"]])
        with torch.no_grad():
            for chunk, rec in ((4, False), (32, False), (0, True)):
                m.kda_chunk, m.kda_recurrent = chunk, rec
                got = m(ids)[0]
                e = rel_l2(got, want)
                print(f"{name}: K3Model ({'recurrent' if rec else f'chunk {chunk}'}) vs reference rel-L2 {e:.2e}")
                ok &= e < 1e-6
        # MXFP4: re-quantising the dequantised shipped experts gives the same bytes
        for base in [k_[:-len(".weight_packed")] for k_ in tensors if k_.endswith(".weight_packed")][:6]:
            pk, sc = tensors[base + ".weight_packed"], tensors[base + ".weight_scale"]
            codes = torch.empty(pk.shape[0], pk.shape[1] * 2, dtype=torch.long)
            codes[:, 0::2] = pk.long() & 15
            codes[:, 1::2] = pk.long() >> 4
            w = K.mxfp4_dequant(codes, sc.long())
            pk2, sc2 = K.mxfp4_pack(w)
            w2 = K.mxfp4_dequant(torch.stack([pk2.long() & 15, pk2.long() >> 4], -1).reshape(codes.shape), sc2.long())
            same = torch.equal(w, w2)
            if not same:
                print(f"{name}: {base}: MXFP4 re-quantisation changed values")
            ok &= same
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
