#!/usr/bin/env python3
"""Perplexity of a released-layout K3 checkpoint by the PyTorch model, with exactly the window
protocol of `k3 eval` (docs/eval.md), for comparing the engine with an independent
implementation. The model is tools/train/k3_model.py in float64 (checked against the fp64
token-by-token reference, tools/reference/k3_reference.py, by tools/train/check_model.py),
loading the shipped tensors as they are (BF16 trunk, MXFP4 experts dequantised).

Tokens: tiktoken with the Kimi pattern over the checkpoint's tiktoken.model (the oracle the C++
tokenizer is tested against), or --ids FILE (whitespace-separated ids).

    python tools/train/eval_reference.py -m models/k3-nano -f valid.txt --ctx 512 --stride 256 --json out.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tools", "tokenizer"))
import k3_model as K  # noqa: E402


def load_model(d: str, dtype=torch.float64) -> K.K3Model:
    tensors = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(d, fn)))
    if "lm_head.weight" in tensors:
        tensors = {"language_model." + k: t for k, t in tensors.items()}
    cfg = K.config_from_json(json.load(open(os.path.join(d, "config.json"))))
    m = K.K3Model(cfg).to(dtype)
    K.load_released(m, tensors)
    m.eval()
    return m


def windows(N: int, ctx: int, stride: int):
    C = min(ctx, N - 1)
    S = min(stride, C)
    starts, s = [], 0
    while True:
        starts.append(s)
        if s + C >= N - 1:
            break
        s = min(s + S, N - 1 - C)
    return C, S, starts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-f", "--file")
    ap.add_argument("--ids", help="token ids instead of --file (whitespace separated)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--stride", type=int, default=0, help="default ctx/2")
    ap.add_argument("--max-tokens", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8, help="windows per forward")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (float64 either way)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.ids:
        x = [int(t) for t in open(a.ids).read().split()]
    else:
        import kimi_ref
        enc = kimi_ref.make_encoding(a.model)
        x = kimi_ref.encode_text(enc, open(a.file, encoding="utf-8").read())
    if a.max_tokens:
        x = x[:a.max_tokens]
    N = len(x)
    stride = a.stride or max(1, a.ctx // 2)
    C, S, starts = windows(N, a.ctx, stride)
    dev = torch.device(a.device)
    if dev.type == "cuda":  # exact fp64 matmuls: no TF32 anywhere
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    m = load_model(a.model).to(dev)
    xt = torch.tensor(x, device=dev)
    nll, done, t0 = 0.0, 0, time.time()
    for i in range(0, len(starts), a.batch):
        grp = starts[i:i + a.batch]
        with torch.no_grad():
            z = m(torch.stack([xt[s:s + C] for s in grp]))  # float64 [b, C, V]
        lp = torch.log_softmax(z.float().double(), dim=-1).cpu()  # from fp32 logits, like the engine
        for j, s in enumerate(grp):
            t = torch.arange(done + 1, s + C + 1)
            nll -= float(lp[j, t - 1 - s, xt.cpu()[t]].sum())
            done = s + C
        print(f"eval_reference: {min(i + a.batch, len(starts))}/{len(starts)} windows, "
              f"ppl so far {math.exp(nll / done):.4f}", file=sys.stderr, flush=True)
    res = {"model": a.model, "file": a.file or a.ids, "tokens": N, "tokens_scored": done, "ctx": C, "stride": S,
           "windows": len(starts), "nll_sum": nll, "nll_mean": nll / done, "perplexity": math.exp(nll / done),
           "seconds": time.time() - t0, "implementation": "tools/train/k3_model.py float64 on " + a.device + " (torch " + torch.__version__ + ")"}
    print(f"perplexity {res['perplexity']:.6f} over {done} tokens (ctx {C}, stride {S})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
