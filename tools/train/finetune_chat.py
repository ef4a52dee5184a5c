#!/usr/bin/env python3
"""Chat fine-tune of K3-nano: continues training the released checkpoint (models/k3-nano) on the
conversations of tools/chat/build_chat_data.py (K3 chat format, loss on the final assistant turns
only) mixed with raw pretraining text (replay, loss on every token), with the routed experts under
MXFP4 fake quantisation for every step (the exported experts are the 4-bit ones the steps used),
and exports it in the released layout with train_nano.export (BF16 trunk, MXFP4 experts, shards of
at most 15 MiB + index).

    python tools/train/finetune_chat.py --model models/k3-nano --data .chatdata --out OUT --steps 600
    python tools/train/finetune_chat.py ... --steps auto --minutes 4        # measure, then fill 4 minutes
    python tools/train/finetune_chat.py ... --tiny-data --steps 3           # CPU smoke test
    python tools/train/finetune_chat.py --model models/k3-nano --merge-from FT --alpha 0.6 --out OUT
                                  # weight interpolation of the base and a fine-tune (CPU, seconds)

Data (DATA/, from build_chat_data.py): chat_ids.u16.gz + chat_index.json.gz (conversations and their
trained spans), raw_train.u16.gz (replay ids), valid.u16.gz (raw validation ids), eval_prompts.jsonl
(held-out prompts with their rendered ids). Conversations are packed whole into rows of --seq
tokens (first fit, order reshuffled every pass, the rest of a row padded and not trained); raw rows
are random --seq-token windows of the replay ids. Each step: --chat-rows chat rows + --raw-rows raw
rows; loss = mean NLL over the trained chat tokens + --raw-weight x mean NLL over the raw tokens.
The marker tokens (<|open|>, <|close|>, <|sep|>, <|end_of_msg|>) never occur in the pretraining
text, so their embedding and output rows start from the mean of the ordinary tokens' rows.

Writes OUT/train_log.jsonl (start, steps, raw validation loss before/during/after, the held-out
prompts' greedy format check at the end, the exported index) and OUT/model-*.safetensors (+
config.json and model.safetensors.index.json unless --shards-only).
"""
from __future__ import annotations

import argparse
import base64
import gzip
import json
import math
import os
import re
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import train_nano as TN  # noqa: E402  (export, evaluate)
from eval_reference import load_model  # noqa: E402

MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")


def read_u16_gz(path: str) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype="<u2").astype(np.int64)


class Vocab:
    """ids -> text without tiktoken (the device has none): ranks from tiktoken.model, specials from
    tokenizer_config.json."""

    def __init__(self, d: str):
        self.tok = {}
        for line in open(os.path.join(d, "tiktoken.model"), "rb"):
            line = line.strip()
            if line:
                t, r = line.split()
                self.tok[int(r)] = base64.b64decode(t)
        cfg = json.load(open(os.path.join(d, "tokenizer_config.json"), encoding="utf-8"))
        self.special = {int(k): v["content"] for k, v in cfg["added_tokens_decoder"].items()}
        self.id_of = {v: k for k, v in self.special.items()}

    def decode(self, ids) -> str:
        out = b""
        for i in ids:
            out += self.special[i].encode() if i in self.special else self.tok.get(i, b"")
        return out.decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------------ output check


def check_reply(text: str, rec: dict) -> dict:
    """The format checks of the acceptance test, on decoded text (markers as their names):
    closed = thinking closed (or never opened: non-thinking prompt) and a non-empty answer;
    call_ok = a call of a declared tool whose arguments include the schema's required keys."""
    think = rec["thinking"] and rec.get("reasoning_effort") != "none"
    closed_think = (not think) or ("<|close|>think<|sep|>" in text) or ("<|open|>response<|sep|>" in text)
    m = re.search(r"<\|open\|>response<\|sep\|>(.*?)(<\|close\|>|<\|open\|>|<\|end_of_msg\|>|$)", text, re.S)
    if not think:
        m = re.match(r"(.*?)(<\|close\|>|<\|open\|>|<\|end_of_msg\|>|$)", text, re.S)
    answer = m.group(1).strip() if m else ""
    res = {"closed": bool(closed_think), "answer": bool(answer), "ended": "<|end_of_msg|>" in text}
    if rec.get("tools"):
        decl = {t["function"]["name"]: t["function"].get("parameters", {}) for t in rec["tools"]}
        ok = False
        for cm in re.finditer(r'<\|open\|>call tool="([^"]*)" index="\d+"<\|sep\|>(.*?)<\|close\|>call<\|sep\|>',
                              text, re.S):
            name, body = cm.group(1), cm.group(2)
            keys = {k for k, _t, _v in re.findall(
                r'<\|open\|>argument key="([^"]*)" type="(\w+)"<\|sep\|>(.*?)<\|close\|>argument<\|sep\|>', body, re.S)}
            if name in decl and set(decl[name].get("required", [])) <= keys:
                ok = True
        res["call_ok"] = ok
    return res


@torch.no_grad()
def greedy_check(model, prompts, vocab, device, max_new=256, batch=48):
    """Greedy replies (no cache: the padded batch is re-run each step; right padding cannot affect
    earlier positions) for the held-out prompts, and their format check."""
    model.eval()
    eom = vocab.id_of["<|end_of_msg|>"]
    results = []
    for b0 in range(0, len(prompts), batch):
        grp = prompts[b0:b0 + batch]
        seqs = [list(p["prompt_ids"]) for p in grp]
        done = [False] * len(grp)
        outs = [[] for _ in grp]
        for _ in range(max_new):
            L = max(len(s) for s in seqs)
            x = torch.full((len(seqs), L), vocab.id_of.get("[PAD]", 0), dtype=torch.long)
            for i, s in enumerate(seqs):
                x[i, :len(s)] = torch.tensor(s)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = model(x.to(device))
            nxt = logits[torch.arange(len(seqs)), torch.tensor([len(s) - 1 for s in seqs])].float().argmax(-1).tolist()
            for i, t in enumerate(nxt):
                if not done[i]:
                    seqs[i].append(t)
                    outs[i].append(t)
                    if t == eom:
                        done[i] = True
            if all(done):
                break
        for p, o in zip(grp, outs):
            text = vocab.decode(o)
            r = check_reply(text, p)
            r.update(id=p["id"], tokens=len(o), text=text[:400])
            results.append(r)
    model.train()
    q = [r for r in results if not r["id"].startswith("t")]
    t = [r for r in results if r["id"].startswith("t")]
    return {"questions": len(q), "closed_and_answered": sum(r["closed"] and r["answer"] for r in q),
            "tool_prompts": len(t), "tool_calls_ok": sum(r.get("call_ok", False) for r in t),
            "replies": results}


# ------------------------------------------------------------------------------------ data


class ChatRows:
    """Whole conversations packed into rows of seq+1 tokens; targets masked to the trained spans."""

    def __init__(self, ids: np.ndarray, index: list, seq: int, pad: int, rng: np.random.Generator):
        self.ids, self.seq, self.pad, self.rng = ids, seq, pad, rng
        self.convs = [c for c in index if c[1] <= seq + 1]
        self.dropped = len(index) - len(self.convs)
        self.rows = []
        self.pos = 0
        self.epoch = 0

    def _pack(self):
        order = self.rng.permutation(len(self.convs))
        rows, cur, used = [], [], 0
        for k in order:
            off, n, spans = self.convs[k]
            if used + n > self.seq + 1:
                rows.append(cur)
                cur, used = [], 0
            cur.append(k)
            used += n
        if cur:
            rows.append(cur)
        self.rows = [rows[i] for i in self.rng.permutation(len(rows))]
        self.pos = 0
        self.epoch += 1

    def next(self, n_rows: int):
        x = np.full((n_rows, self.seq + 1), self.pad, dtype=np.int64)
        m = np.zeros((n_rows, self.seq + 1), dtype=bool)
        for r in range(n_rows):
            if self.pos >= len(self.rows):
                self._pack()
            at = 0
            for k in self.rows[self.pos]:
                off, n, spans = self.convs[k]
                x[r, at:at + n] = self.ids[off:off + n]
                for s, e in spans:
                    m[r, at + s:at + e] = True
                at += n
            self.pos += 1
        return torch.from_numpy(x), torch.from_numpy(m)


def raw_rows(ids: np.ndarray, n_rows: int, seq: int, rng: np.random.Generator):
    starts = rng.integers(0, len(ids) - seq - 1, n_rows)
    return torch.from_numpy(np.stack([ids[s:s + seq + 1] for s in starts]))


# ------------------------------------------------------------------------------------ merge


def merge(a) -> int:
    """Interpolates the released base checkpoint (--model) and a fine-tuned one (--merge-from) in
    weight space: theta = base + alpha (ft - base), every tensor (MXFP4 experts dequantised,
    interpolated, re-quantised by the export); the rows of the four marker tokens, which the base
    never trained, are taken from the fine-tune whole. Exports like a training run (CPU is enough)."""
    base = load_model(a.model, dtype=torch.float32)
    ft = load_model(a.merge_from, dtype=torch.float32)
    vocab = Vocab(a.model)
    fsd = dict(ft.named_parameters())
    fsd.update(dict(ft.named_buffers()))
    with torch.no_grad():
        for n, t in list(base.named_parameters()) + list(base.named_buffers()):
            f = fsd[n]
            if n in ("embed_tokens", "lm_head"):
                t.add_(a.alpha * (f - t))
                for m in MARKERS:
                    t[vocab.id_of[m]] = f[vocab.id_of[m]]
            else:
                t.add_(a.alpha * (f - t))
    os.makedirs(a.out, exist_ok=True)
    total = TN.export(base, a.out)
    with open(os.path.join(a.out, "merge.json"), "w") as fo:
        json.dump({"base": a.model, "fine_tuned": a.merge_from, "alpha": a.alpha, "export_bytes": total,
                   "rule": "base + alpha * (fine_tuned - base); marker rows of embed_tokens/lm_head from fine_tuned"},
                  fo, indent=2)
        fo.write("\n")
    print(f"merged alpha {a.alpha}: {total} bytes -> {a.out}")
    return 0


# ------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(REPO, "models", "k3-nano"))
    ap.add_argument("--data", default=os.path.join(REPO, ".chatdata"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", default="auto", help="number of steps, or auto (fill --minutes)")
    ap.add_argument("--minutes", type=float, default=4.0, help="training wall budget for --steps auto")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--chat-rows", type=int, default=24)
    ap.add_argument("--raw-rows", type=int, default=8)
    ap.add_argument("--raw-weight", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--bias-rate", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--kda-chunk", type=int, default=32)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--valid-windows", type=int, default=128)
    ap.add_argument("--export-every", type=float, default=150.0, help="seconds between exports")
    ap.add_argument("--check-max-new", type=int, default=256, help="greedy tokens per held-out prompt (0: skip)")
    ap.add_argument("--shards-only", action="store_true",
                    help="leave only the shards and the log in OUT (the index goes into the log)")
    ap.add_argument("--tiny-data", action="store_true", help="CPU smoke test: a few conversations, short rows")
    ap.add_argument("--tag", default="ft", help="prefix of the lines printed (several runs side by side)")
    ap.add_argument("--merge-from", metavar="FT_DIR",
                    help="no training: write base + ALPHA x (FT_DIR - base) (weight interpolation, WiSE-FT) to --out")
    ap.add_argument("--alpha", type=float, default=0.7)
    a = ap.parse_args(argv)
    if a.merge_from:
        return merge(a)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    os.makedirs(a.out, exist_ok=True)
    log = open(os.path.join(a.out, "train_log.jsonl"), "w")

    def emit(rec, quiet=False):
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if not quiet:
            print(f"[{a.tag}] " + json.dumps(rec)[:400], flush=True)

    # data
    chat_ids = read_u16_gz(os.path.join(a.data, "chat_ids.u16.gz"))
    with gzip.open(os.path.join(a.data, "chat_index.json.gz"), "rt") as f:
        index = json.load(f)
    raw_ids = read_u16_gz(os.path.join(a.data, "raw_train.u16.gz"))
    valid_ids = read_u16_gz(os.path.join(a.data, "valid.u16.gz"))
    prompts = [json.loads(l) for l in open(os.path.join(a.data, "eval_prompts.jsonl"), encoding="utf-8")]
    if a.tiny_data:
        index = index[:200]
        valid_ids = valid_ids[:20000]
        prompts = prompts[:2] + [p for p in prompts if p["id"].startswith("t")][:2]
    vocab = Vocab(a.model)
    pad = vocab.id_of.get("[PAD]", 0)
    chat = ChatRows(chat_ids, index, a.seq, pad, rng)

    # model: the released checkpoint (MXFP4 experts dequantised), float32 master weights
    model = load_model(a.model, dtype=torch.float32).to(device)
    model.kda_chunk = a.kda_chunk
    model.train()
    cfg = model.c
    with torch.no_grad():  # markers never occur in the pretraining text: start from the mean rows
        n_ord = cfg.vocab - 256
        emb_mean = model.embed_tokens[:n_ord].mean(0)
        head_mean = model.lm_head[:n_ord].mean(0)
        for mk in MARKERS:
            i = vocab.id_of[mk]
            model.embed_tokens[i] = emb_mean
            model.lm_head[i] = head_mean
    model.set_fake_quant(True)
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and "conv1d" not in n else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    moes = [l.block_sparse_moe for l in model.layers if l.block_sparse_moe is not None]
    n_trained = sum(sum(e - s for s, e in c[2]) for c in chat.convs)
    emit({"event": "start", "device": str(device), "torch": torch.__version__, "args": vars(a),
          "conversations": len(chat.convs), "dropped_longer_than_seq": chat.dropped,
          "chat_tokens": int(len(chat_ids)), "trained_chat_tokens": int(n_trained), "raw_tokens": int(len(raw_ids)),
          "valid_tokens": int(len(valid_ids)), "params": sum(p.numel() for p in model.parameters())})
    v0 = TN.evaluate(model, valid_ids, 512, a.valid_windows, device)
    emit({"event": "valid_before", "valid_loss": v0, "valid_ppl": math.exp(v0)})

    def step_fn(lr):
        for gr in opt.param_groups:
            gr["lr"] = lr
        xc, mc = chat.next(a.chat_rows)
        xr = raw_rows(raw_ids, a.raw_rows, a.seq, rng) if a.raw_rows else None
        x = torch.cat([xc, xr]) if xr is not None else xc
        x = x.to(device, non_blocking=True)
        mc = mc.to(device, non_blocking=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x[:, :-1])
        nll = F.cross_entropy(logits.float().reshape(-1, cfg.vocab), x[:, 1:].reshape(-1),
                              reduction="none").view(x.shape[0], -1)
        tm = mc[:, 1:]
        lc = (nll[:a.chat_rows] * tm).sum() / tm.sum().clamp_min(1)
        lr_ = nll[a.chat_rows:].mean() if xr is not None else torch.zeros((), device=device)
        loss = lc + a.raw_weight * lr_
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for m in moes:
            m.update_bias(a.bias_rate)
        return lc, lr_, gn

    # step count: given, or measured on a copy of the state (restored afterwards)
    t_start = time.time()
    if a.steps == "auto":
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for i in range(13):
            if i == 3:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.time()
            step_fn(0.0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        per_step = (time.time() - t0) / 10
        steps = max(10, int(a.minutes * 60 / per_step))
        model.load_state_dict(state)
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
        chat.pos, chat.rows = 0, []
        emit({"event": "auto_steps", "seconds_per_step": per_step, "steps": steps,
              "max_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None})
    else:
        steps = int(a.steps)

    def do_export():
        total = TN.export(model, a.out)
        idx = json.load(open(os.path.join(a.out, "model.safetensors.index.json")))
        if a.shards_only:
            for fn in ("model.safetensors.index.json", "config.json"):
                os.remove(os.path.join(a.out, fn))
        return total, idx

    t_train = time.time()
    last_export = time.time()
    tokens = 0
    for step in range(steps):
        if step < a.warmup:
            lr = a.lr * (step + 1) / a.warmup
        else:
            pr = (step - a.warmup) / max(1, steps - a.warmup)
            lr = a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * pr)))
        lc, lr_, gn = step_fn(lr)
        tokens += (a.chat_rows + a.raw_rows) * a.seq
        if step % a.log_every == 0 or step == steps - 1:
            el = time.time() - t_train
            rec = {"step": step, "chat_loss": float(lc.detach()), "raw_loss": float(lr_.detach()), "lr": lr,
                   "grad_norm": float(gn), "tokens": tokens, "elapsed_s": el, "chat_epoch": chat.epoch}
            if (step % a.eval_every == 0 and step > 0) or step == steps - 1:
                rec["valid_loss"] = TN.evaluate(model, valid_ids, 512, a.valid_windows, device)
                load = torch.stack([m.last_load.float() for m in moes])
                rec["expert_load_cv"] = float((load.std(1) / load.mean(1)).mean())
            emit(rec)
        if time.time() - last_export > a.export_every:
            do_export()
            last_export = time.time()
    train_s = time.time() - t_train
    total, idx = do_export()
    v1 = TN.evaluate(model, valid_ids, 512, a.valid_windows, device)
    emit({"event": "done", "steps": steps, "tokens": tokens, "train_seconds": train_s,
          "valid_loss_before": v0, "valid_loss_after": v1, "valid_ppl_before": math.exp(v0),
          "valid_ppl_after": math.exp(v1), "ppl_ratio": math.exp(v1 - v0), "export_bytes": total,
          "chat_epochs": chat.epoch})
    emit({"event": "index", "index": idx}, quiet=True)
    if a.check_max_new > 0 and prompts:
        t0 = time.time()
        chk = greedy_check(model, prompts, vocab, device, a.check_max_new)
        emit({"event": "greedy_check", "seconds": time.time() - t0,
              **{k: v for k, v in chk.items() if k != "replies"}})
        for r in chk["replies"]:
            emit({"event": "reply", **r}, quiet=True)
    emit({"event": "end", "total_seconds": time.time() - t_start})
    return 0


if __name__ == "__main__":
    sys.exit(main())
