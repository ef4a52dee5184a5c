#!/usr/bin/env python3
# Unigram baseline for K3-nano: per-token perplexity on build/corpus/valid.u16 of a unigram model fitted
# on the token counts of build/corpus/train.u16, with add-one (Laplace) smoothing over the whole model
# vocabulary (ranks + 256 specials = 8,448 ids):  p(i) = (count_train(i) + 1) / (N_train + V).
# Writes docs/data/k3-nano-unigram.json.
#
#   build/corpus/venv/bin/python tools/corpus/unigram_baseline.py     (after encode_corpus.py)
import argparse
import array
import collections
import hashlib
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_u16(p):
    a = array.array("H")
    with open(p, "rb") as f:
        a.frombytes(f.read())
    if sys.byteorder != "little":
        a.byteswap()
    return a


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default=os.path.join(REPO, "build/corpus"))
    ap.add_argument("--out", default=os.path.join(REPO, "docs/data/k3-nano-unigram.json"))
    args = ap.parse_args()
    meta = json.load(open(os.path.join(args.corpus, "meta.json")))
    V = meta["vocab_size"]
    train = load_u16(os.path.join(args.corpus, "train.u16"))
    valid = load_u16(os.path.join(args.corpus, "valid.u16"))
    counts = collections.Counter(train)
    n = len(train)
    log_denom = math.log(n + V)
    logp = {i: math.log(c + 1) - log_denom for i, c in counts.items()}
    log_unseen = -log_denom
    valid_counts = collections.Counter(valid)
    nll = -sum(c * logp.get(i, log_unseen) for i, c in valid_counts.items())
    mean_nll = nll / len(valid)
    valid_bytes = meta["splits"]["valid"]["text_bytes"]
    out = dict(
        description="Per-token perplexity on build/corpus/valid.u16 of a unigram model fitted on the token "
                    "counts of build/corpus/train.u16, add-one smoothing over all vocab_size ids",
        command="build/corpus/venv/bin/python tools/corpus/unigram_baseline.py",
        vocab_size=V, smoothing="add-one", train_tokens=n, valid_tokens=len(valid),
        train_ids_seen=len(counts), valid_ids_unseen_in_train=sum(1 for i in valid_counts if i not in counts),
        perplexity=round(math.exp(mean_nll), 3),
        nll_nats_per_token=round(mean_nll, 5),
        bits_per_token=round(mean_nll / math.log(2), 5),
        bits_per_byte=round(nll / math.log(2) / valid_bytes, 5),
        valid_bytes=valid_bytes,
        train_ids_sha256=meta["splits"]["train"]["ids_sha256"],
        valid_ids_sha256=meta["splits"]["valid"]["ids_sha256"],
        tiktoken_model_sha256=meta["tiktoken_model_sha256"],
    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"unigram perplexity {out['perplexity']} ({out['bits_per_token']} bits/token, "
          f"{out['bits_per_byte']} bits/byte) on {len(valid)} valid tokens -> {args.out}")


if __name__ == "__main__":
    main()
