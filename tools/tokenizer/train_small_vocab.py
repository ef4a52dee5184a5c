#!/usr/bin/env python3
# Trains the SMALL tiktoken-format vocabulary checked in under tests/fixtures/tokenizer-small/
# (byte-level BPE, 256 byte ranks + merges), and writes its reference ids from the tiktoken oracle.
# Test fixture generation only; rerun by hand (deterministic given the input files listed below).
import argparse
import base64
import collections
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kimi_ref  # noqa: E402
import setup_vocab  # noqa: E402

K3_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
               6: "[start_header_id]", 7: "[end_header_id]", 9: "[EOT]", 18: "<|media_begin|>",
               19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>", 65: "<osagent_mode>",
               254: "[UNK]", 255: "[PAD]"}


def train(text_pieces, n_merges):
    # the 12,000 most frequent pieces are plenty for a few thousand merges and keep training fast
    words = dict(collections.Counter(text_pieces).most_common(12000))
    seqs = {w: [bytes([b]) for b in w] for w in words}
    ranks = {bytes([i]): i for i in range(256)}
    for _ in range(n_merges):
        pairs = collections.Counter()
        for w, c in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        new = a + b
        if new in ranks:
            continue
        ranks[new] = len(ranks)
        for w in words:
            s = seqs[w]
            if len(s) < 2:
                continue
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return ranks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--merges", type=int, default=2000)
    args = ap.parse_args()
    import regex
    docs = setup_vocab.gather_corpus()
    rng = random.Random(7)
    sample = [d.decode("utf-8", errors="ignore")[:20000] for _, d in rng.sample(docs, 40)]
    pat = regex.compile(r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}{1,3}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    pieces = [p.encode("utf-8") for t in sample for p in pat.findall(t)]
    ranks = train(pieces, args.merges)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tiktoken.model"), "wb") as f:
        for tok, r in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(tok) + b" " + str(r).encode() + b"\n")
    n = len(ranks)
    added = {}
    for i in range(256):
        added[str(n + i)] = {"content": K3_SPECIALS.get(i, f"<|reserved_token_{n + i}|>"), "special": True}
    with open(os.path.join(args.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"added_tokens_decoder": added, "eos_token": "<|end_of_msg|>"}, f, ensure_ascii=False, indent=1)
    enc = kimi_ref.make_encoding(args.out)
    # reference cases: fuzz strings + lines of the corpus (hex bytes TAB ids)
    cases = setup_vocab.fuzz_strings(seed=5, n=3000)
    for _, d in rng.sample(docs, 40):
        lines = d.split(b"\n")
        for ln in rng.sample(lines, min(25, len(lines))):
            cases.append(ln[:300] + b"\n")
    cases.append(b" " * 30010 + b"x")  # long whitespace run rule
    with open(os.path.join(args.out, "reference.tsv"), "w") as f:
        f.write("# hex(input bytes)\tids from tiktoken " + __import__("tiktoken").__version__ +
                " + Kimi split pattern (tools/tokenizer/kimi_ref.py)\n")
        for b in cases:
            ids = kimi_ref.encode_bytes(enc, b)
            f.write(b.hex() + "\t" + " ".join(map(str, ids)) + "\n")
    print("ranks", n, "cases", len(cases))


if __name__ == "__main__":
    main()
