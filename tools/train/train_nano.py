#!/usr/bin/env python3
"""Trains K3-nano (tools/train/k3_model.py, NanoConfig defaults) on the token ids written by
tools/corpus/encode_corpus.py and exports it in the released Kimi K3 layout (nested config.json,
`language_model.` names, BF16 trunk, MXFP4 routed experts, shards of at most 15 MiB + index).

The routed experts train with MXFP4 fake quantisation (straight-through) for the last
--qat-fraction of the steps, so the exported 4-bit experts are the ones the final steps used.
Router balance uses DeepSeek-V3's aux-loss-free bias update. One run is deterministic for a given
(seed, steps, batch) on one device type, up to the GPU's non-deterministic reductions.

    python tools/train/train_nano.py --data build/corpus --out build/k3-nano-train --steps 3000
    python tools/train/train_nano.py ... --steps auto --minutes 8   # measure, then fill 8 minutes

Writes OUT/{config.json, model-*.safetensors, model.safetensors.index.json, train_log.jsonl}.
The export is refreshed every --export-every seconds, so a run cut short still leaves a model.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tools", "gen"))
import k3_model as K  # noqa: E402

SHARD_LIMIT = 15 << 20


def load_ids(path: str) -> np.ndarray:
    return np.fromfile(path, dtype="<u2").astype(np.int64)


def batches(ids: np.ndarray, batch: int, seq: int, gen: torch.Generator):
    n = len(ids) - seq - 1
    while True:
        starts = torch.randint(0, n, (batch,), generator=gen).numpy()
        x = np.stack([ids[s:s + seq + 1] for s in starts])
        yield torch.from_numpy(x)


def preset_of(c: K.NanoConfig) -> dict:
    """NanoConfig -> the preset dict tools/gen/gen_tiny_checkpoint.make_config takes."""
    return dict(nested=True, trunk_dtype="bf16", shards=1, hidden=c.hidden, layers=c.layers,
                mla_layers=list(c.mla_layers), block=c.block, kda_heads=c.kda_heads, kda_dim=c.kda_dim,
                conv=c.conv, mla_heads=c.mla_heads, q_lora=c.q_lora, kv_lora=c.kv_lora, nope=c.nope,
                rope=c.rope, v=c.v, dense_inter=c.dense_inter, first_dense=c.first_dense,
                experts=c.experts, topk=c.topk, shared=c.shared, moe_inter=c.moe_inter, latent=c.latent,
                vocab=c.vocab, vision=True,
                special_ids=dict(bos_token_id=c.vocab - 256, eos_token_id=c.vocab - 254, pad_token_id=c.vocab - 1))


# dtype of each exported tensor (as in the released checkpoint): small float vectors the engine
# uses in float32 stay F32; everything else in the trunk is BF16.
F32_SUFFIXES = ("_conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")


def export(model: K.K3Model, out: str) -> int:
    import gen_tiny_checkpoint as G
    os.makedirs(out, exist_ok=True)
    c = model.c
    cfg = G.make_config(preset_of(c))
    with open(os.path.join(out, "config.json.tmp"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    tensors = {}
    for pname, p in list(model.named_parameters()) + list(model.named_buffers()):
        if ".experts.w" in pname:
            continue
        rn = K.released_name(pname)
        t = p.detach().float().cpu()
        if rn.endswith("_res_proj.weight"):
            t = t.reshape(1, -1)
        tensors[rn] = t.contiguous() if rn.endswith(F32_SUFFIXES) else t.to(torch.bfloat16).contiguous()
    for lay in model.layers:
        if lay.block_sparse_moe is None:
            continue
        ex = lay.block_sparse_moe.experts
        for e in range(c.experts):
            for which in ("w1", "w2", "w3"):
                base = f"{K.PREFIX}layers.{lay.L}.block_sparse_moe.experts.{e}.{which}"
                pk, sc = K.mxfp4_pack(getattr(ex, which)[e].detach().float().cpu())
                tensors[base + ".weight_packed"] = pk.contiguous()
                tensors[base + ".weight_scale"] = sc.contiguous()
    # shards in name order, each at most SHARD_LIMIT bytes
    shards, cur, size = [], {}, 0
    for name in sorted(tensors):
        nb = tensors[name].numel() * tensors[name].element_size()
        if cur and size + nb > SHARD_LIMIT:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = tensors[name]
        size += nb
    shards.append(cur)
    for fn in os.listdir(out):
        if fn.startswith("model-") and fn.endswith(".safetensors"):
            os.remove(os.path.join(out, fn))
    wm, total = {}, 0
    for i, grp in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(grp, os.path.join(out, fn + ".tmp"), metadata={"format": "pt"})
        os.replace(os.path.join(out, fn + ".tmp"), os.path.join(out, fn))
        for name, t in grp.items():
            wm[name] = fn
            total += t.numel() * t.element_size()
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(wm.items()))}, f, indent=2)
        f.write("\n")
    os.replace(os.path.join(out, "config.json.tmp"), os.path.join(out, "config.json"))
    return total


@torch.no_grad()
def evaluate(model: K.K3Model, ids: np.ndarray, seq: int, n_windows: int, device) -> float:
    """Mean next-token NLL over n_windows fixed, evenly spaced windows of the validation ids."""
    model.eval()
    starts = np.linspace(0, len(ids) - seq - 1, n_windows).astype(np.int64)
    tot, cnt = 0.0, 0
    for i in range(0, n_windows, 16):
        x = torch.from_numpy(np.stack([ids[s:s + seq + 1] for s in starts[i:i + 16]])).to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        tot += float(loss)
        cnt += x[:, 1:].numel()
    model.train()
    return tot / cnt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.path.join(REPO, "build", "corpus"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", default="auto", help="number of steps, or auto (fill --minutes)")
    ap.add_argument("--minutes", type=float, default=8.0, help="wall budget for --steps auto (training only)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--qat-fraction", type=float, default=0.4)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--kda-chunk", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--export-every", type=float, default=120.0, help="seconds between exports")
    ap.add_argument("--tiny", action="store_true", help="a very small config (CPU smoke tests)")
    a = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    meta = json.load(open(os.path.join(a.data, "meta.json")))
    train_ids, valid_ids = load_ids(os.path.join(a.data, "train.u16")), load_ids(os.path.join(a.data, "valid.u16"))
    vocab = int(meta.get("model_vocab") or meta["vocab_size"])  # ranks + the 256 K3 special tokens
    cfg = K.NanoConfig(vocab=vocab)
    if a.tiny:
        cfg = K.NanoConfig(vocab=vocab, hidden=64, kda_heads=2, kda_dim=32, mla_heads=2, q_lora=32,
                           kv_lora=32, nope=16, rope=8, v=16, dense_inter=128, experts=8, topk=2, moe_inter=64, latent=32)
    def build():
        """Model, optimiser and data stream, all from the seed (the auto-step measurement rebuilds)."""
        torch.manual_seed(a.seed)
        m = K.K3Model(cfg).to(device)
        m.kda_chunk = a.kda_chunk
        decay, no_decay = [], []
        for n, p in m.named_parameters():
            (decay if p.ndim >= 2 and "conv1d" not in n else no_decay).append(p)
        o = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
        g = torch.Generator().manual_seed(a.seed)
        return m, o, batches(train_ids, a.batch, a.seq, g), [l.block_sparse_moe for l in m.layers if l.block_sparse_moe is not None]

    model, opt, data, moes = build()
    n_params = sum(p.numel() for p in model.parameters())
    os.makedirs(a.out, exist_ok=True)
    log = open(os.path.join(a.out, "train_log.jsonl"), "w")

    def emit(rec):
        log.write(json.dumps(rec) + "\n")
        log.flush()
        print(json.dumps(rec), flush=True)

    emit({"event": "start", "params": n_params, "device": str(device), "config": cfg.__dict__, "args": vars(a),
          "train_tokens": int(len(train_ids)), "valid_tokens": int(len(valid_ids)),
          "torch": torch.__version__})

    def step_fn(x, lr):
        for gr in opt.param_groups:
            gr["lr"] = lr
        x = x.to(device, non_blocking=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for m in moes:
            m.update_bias(a.bias_rate)
        return loss, gn

    # Step count: given, or measured (20 steps after 5 warm-up ones, QAT on to be conservative).
    t_start = time.time()
    if a.steps == "auto":
        model.set_fake_quant(True)
        for i in range(25):
            if i == 5:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.time()
            step_fn(next(data), 1e-9)
        if device.type == "cuda":
            torch.cuda.synchronize()
        per_step = (time.time() - t0) / 20
        steps = max(10, int(a.minutes * 60 / per_step))
        emit({"event": "auto_steps", "seconds_per_step": per_step, "steps": steps,
              "max_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None})
        # restart from a clean model and optimiser with the same seed: the measurement is not training
        model, opt, data, moes = build()
    else:
        steps = int(a.steps)
    qat_from = int(steps * (1 - a.qat_fraction))
    model.set_fake_quant(False)
    t_train = time.time()
    last_export = time.time()
    tokens = 0
    for step in range(steps):
        if step == qat_from:
            model.set_fake_quant(True)
            emit({"event": "qat_on", "step": step})
        if step < a.warmup:
            lr = a.lr * (step + 1) / a.warmup
        else:
            pr = (step - a.warmup) / max(1, steps - a.warmup)
            lr = a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * pr)))
        loss, gn = step_fn(next(data), lr)
        tokens += a.batch * a.seq
        if step % 25 == 0 or step == steps - 1:
            el = time.time() - t_train
            rec = {"step": step, "loss": float(loss.detach()), "lr": lr, "grad_norm": float(gn), "tokens": tokens,
                   "elapsed_s": el, "tok_per_s": tokens / max(el, 1e-9)}
            if step % a.eval_every == 0 or step == steps - 1:
                rec["valid_loss"] = evaluate(model, valid_ids, a.seq, 64, device)
                load = torch.stack([m.last_load.float() for m in moes])
                rec["expert_load_cv"] = float((load.std(1) / load.mean(1)).mean())
            emit(rec)
        if time.time() - last_export > a.export_every:
            export(model, a.out)
            last_export = time.time()
    model.set_fake_quant(True)
    total = export(model, a.out)
    final = evaluate(model, valid_ids, a.seq, 256, device)
    emit({"event": "done", "steps": steps, "tokens": tokens, "train_seconds": time.time() - t_train,
          "total_seconds": time.time() - t_start, "valid_loss_qat": final, "valid_ppl_qat": math.exp(final),
          "export_bytes": total})
    return 0


if __name__ == "__main__":
    sys.exit(main())
