#!/usr/bin/env python3
"""Validate k3_reference.py against the third-party whole-model fixture kimi-k3-in-c-tiny.

Gate (exit status 1 on failure, 0 on success, 77 = skipped when the fixture folder is absent):
  * argmax of one teacher-forced pass over full_ids == tf_pred exactly;
  * logits_head (first 8 logits per position) within 1e-4 using the spec's MLA LoRA-norm
    eps 1e-6 (the fixture's project used 1e-5; the max difference for both is reported);
  * the greedy continuation (full recompute per token) of prompt_ids == full_ids[len(prompt):];
  * when the sibling kimi-k3-in-c-ops/mxfp4.json exists: dequant_mxfp4 of its 64 rows of real
    released MXFP4 bytes equals the expected floats exactly.

Usage: python tools/reference/check_third_party.py [FIXTURE_DIR]
Default FIXTURE_DIR: ../shared/fixtures/third-party/kimi-k3-in-c-tiny relative to the repo root,
else /work/shared/fixtures/third-party/kimi-k3-in-c-tiny.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from k3_reference import K3Reference, dequant_mxfp4  # noqa: E402

TOL = 1e-4


def default_dir() -> str:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for cand in (os.path.join(repo, "..", "shared", "fixtures", "third-party", "kimi-k3-in-c-tiny"),
                 "/work/shared/fixtures/third-party/kimi-k3-in-c-tiny"):
        if os.path.isdir(cand):
            return os.path.normpath(cand)
    return ""


def main() -> int:
    fx = sys.argv[1] if len(sys.argv) > 1 else default_dir()
    if not fx or not os.path.isdir(fx):
        print("SKIP: third-party fixture kimi-k3-in-c-tiny not found")
        return 77
    with open(os.path.join(fx, "expected.json")) as f:
        exp = json.load(f)
    full = exp["full_ids"]
    prompt = exp["prompt_ids"]
    tf_pred = exp["tf_pred"]
    head = torch.tensor(exp["logits_head"], dtype=torch.float64)
    ok = True
    results = {}
    full_logits = {}
    for eps in (1e-6, 1e-5):
        m = K3Reference(fx, mla_lora_norm_eps=eps)
        logits = m.forward(full)
        am = logits.argmax(-1).tolist()
        diff = float((logits[:, : head.shape[1]] - head).abs().max())
        mism = sum(int(a != b) for a, b in zip(am, tf_pred))
        srt = logits.sort(dim=-1, descending=True).values
        margin = float((srt[:, 0] - srt[:, 1]).min())
        results[eps] = (diff, mism)
        full_logits[eps] = logits
        print(f"mla_lora_norm_eps={eps:g}: tf argmax mismatches {mism}/{len(tf_pred)}, "
              f"max |logits_head diff| {diff:.6e}, min top1-top2 margin {margin:.3e}")
        if eps == 1e-6:
            if mism != 0 or len(am) != len(tf_pred):
                print("FAIL: teacher-forced argmax differs from tf_pred")
                ok = False
            if diff > TOL:
                print(f"FAIL: logits_head differ by more than {TOL}")
                ok = False
            gen = m.greedy(prompt, len(full) - len(prompt))
            if gen != full[len(prompt):]:
                print(f"FAIL: greedy {gen} != expected {full[len(prompt):]}")
                ok = False
            else:
                print(f"greedy continuation of {len(prompt)} prompt ids: {len(gen)} tokens match")
    d = float((full_logits[1e-6] - full_logits[1e-5]).abs().max())
    print(f"max |logits(eps 1e-6) - logits(eps 1e-5)| over all {tuple(full_logits[1e-6].shape)} logits: {d:.3e}")
    mx = os.path.join(os.path.dirname(fx), "kimi-k3-in-c-ops", "mxfp4.json")
    if os.path.exists(mx):
        with open(mx) as f:
            j = json.load(f)
        packed = torch.tensor(j["packed"]["data"], dtype=torch.uint8).view(*j["packed"]["shape"])
        scales = torch.tensor(j["scales"]["data"], dtype=torch.uint8).view(*j["scales"]["shape"])
        want = torch.tensor(j["expected"]["data"], dtype=torch.float64).view(*j["expected"]["shape"])
        got = dequant_mxfp4(packed, scales)
        same = bool(torch.equal(got, want)) and bool(torch.equal(torch.signbit(got), torch.signbit(want)))
        print(f"mxfp4.json: {tuple(got.shape)} dequantized values {'match exactly' if same else 'DIFFER'}")
        ok = ok and same
    else:
        print("mxfp4.json not found; MXFP4 check skipped")
    print("PASS" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
