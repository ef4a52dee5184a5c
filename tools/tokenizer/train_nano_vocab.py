#!/usr/bin/env python3
# Trains the K3-nano vocabulary: a byte-level BPE with 8,192 ranks (the 256 single bytes + 7,936
# merged tokens) on build/corpus/train.txt, pre-tokenized with the Kimi split pattern of
# tools/tokenizer/kimi_ref.py. Writes models/k3-nano/tiktoken.model (base64(token bytes) SP rank,
# ranks 0..N-1) and tokenizer_config.json (the 256 K3 special tokens at N..N+255, same names and
# offsets as tests/fixtures/tokenizer-small/, "add_bos_token": false, eos "<|end_of_msg|>").
#
#   build/corpus/venv/bin/python tools/tokenizer/train_nano_vocab.py      (after tools/corpus/build_corpus.sh)
#
# Algorithm: count the pre-tokenized pieces of the whole training text, then run BPE over the unique
# pieces with incremental pair counts (pair -> count, pair -> words containing it, a lazy max-heap).
# Each step merges the most frequent adjacent pair; ties go to the smaller (left id, right id).
# Every unique piece takes part (no cap: --min-count 1, the default; a larger value would leave out
# rarer pieces and is reported in the log). If a merge yields bytes that are already a token (two different
# splits of the same string), the words are merged into that token and no rank is added.
# Deterministic: no randomness, no dependence on hash seeds (only ints and bytes are hashed and the
# heap order is total).
import argparse
import base64
import collections
import heapq
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import kimi_ref  # noqa: E402

# same table as tools/tokenizer/train_small_vocab.py (offsets of the named K3 specials)
K3_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
               6: "[start_header_id]", 7: "[end_header_id]", 9: "[EOT]", 18: "<|media_begin|>",
               19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>", 65: "<osagent_mode>",
               254: "[UNK]", 255: "[PAD]"}
DOC_SEP = "\n\n\n"  # tools/corpus/build_corpus.py


def count_pieces(path):
    import regex
    pat = regex.compile(kimi_ref.KIMI_PAT, flags=regex.V1)
    counts = collections.Counter()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    # split at document boundaries, keeping the separator on the left part: no Kimi piece can cross
    # "\n\n\n" + the next document's first (non-space) character, so this equals one pass over the file
    parts = text.split(DOC_SEP)
    for i, doc in enumerate(parts):
        counts.update(pat.findall(doc + DOC_SEP if i + 1 < len(parts) else doc))
    n_docs = len(parts)
    out = collections.Counter()
    for piece, c in counts.items():
        if c > 0:
            out[piece.encode("utf-8")] += c
    return out, n_docs, len(text)


def train(piece_counts, vocab_size, min_count, log_every=500):
    items = sorted((p, c) for p, c in piece_counts.items() if c >= min_count and len(p) >= 2)
    words = [list(p) for p, _ in items]
    counts = [c for _, c in items]
    tok_bytes = [bytes([i]) for i in range(256)]
    by_bytes = {b: i for i, b in enumerate(tok_bytes)}
    pair_count = collections.defaultdict(int)
    where = collections.defaultdict(set)
    for wi, w in enumerate(words):
        c = counts[wi]
        for a, b in zip(w, w[1:]):
            pair_count[(a, b)] += c
            where[(a, b)].add(wi)
    heap = [(-c, a, b) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)
    merges_done = reused = 0
    t0 = time.time()
    while len(tok_bytes) < vocab_size and heap:
        negc, a, b = heapq.heappop(heap)
        if pair_count.get((a, b), 0) != -negc or negc == 0:
            continue  # stale heap entry
        new_b = tok_bytes[a] + tok_bytes[b]
        if new_b in by_bytes:
            nid = by_bytes[new_b]
            reused += 1
        else:
            nid = len(tok_bytes)
            tok_bytes.append(new_b)
            by_bytes[new_b] = nid
        merges_done += 1
        changed = set()
        for wi in sorted(where.pop((a, b))):
            w = words[wi]
            c = counts[wi]
            out, i, n = [], 0, len(w)
            while i < n:
                if i + 1 < n and w[i] == a and w[i + 1] == b:
                    out.append(nid)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            old_pairs = list(zip(w, w[1:]))
            new_pairs = list(zip(out, out[1:]))
            for p in old_pairs:
                pair_count[p] -= c
                changed.add(p)
            for p in new_pairs:
                pair_count[p] += c
                changed.add(p)
            new_set = set(new_pairs)
            for p in set(old_pairs) - new_set:
                s = where.get(p)
                if s is not None:
                    s.discard(wi)
            for p in new_set:
                where[p].add(wi)
            words[wi] = out
        pair_count.pop((a, b), None)
        changed.discard((a, b))
        for p in sorted(changed):
            c = pair_count.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p[0], p[1]))
            else:
                pair_count.pop(p, None)
                where.pop(p, None)
        if log_every and merges_done % log_every == 0:
            print(f"  merge {merges_done}: vocab {len(tok_bytes)} count {-negc} "
                  f"{new_b!r} ({time.time() - t0:.0f}s)", flush=True)
    return tok_bytes, merges_done, reused, len(words)


def write_vocab(out_dir, tok_bytes):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tiktoken.model"), "wb") as f:
        for r, tok in enumerate(tok_bytes):
            f.write(base64.b64encode(tok) + b" " + str(r).encode() + b"\n")
    n = len(tok_bytes)
    added = {}
    for i in range(256):
        added[str(n + i)] = {"content": K3_SPECIALS.get(i, f"<|reserved_token_{n + i}|>"), "special": True}
    cfg = {"added_tokens_decoder": added, "add_bos_token": False, "eos_token": "<|end_of_msg|>"}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=1)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", default=os.path.join(REPO, "build/corpus/train.txt"))
    ap.add_argument("--out", default=os.path.join(REPO, "models/k3-nano"))
    ap.add_argument("--ranks", type=int, default=8192, help="ranks incl. the 256 single bytes")
    ap.add_argument("--min-count", type=int, default=1, help="pieces seen fewer times are left out")
    args = ap.parse_args()
    t0 = time.time()
    pieces, n_docs, n_chars = count_pieces(args.train)
    t1 = time.time()
    total = sum(pieces.values())
    kept = sum(c for p, c in pieces.items() if c >= args.min_count)
    print(f"pre-tokenized {n_chars} chars, {n_docs} docs: {total} pieces, {len(pieces)} unique "
          f"({t1 - t0:.0f}s); min-count {args.min_count} keeps "
          f"{sum(1 for c in pieces.values() if c >= args.min_count)} unique = {100 * kept / total:.2f}% "
          f"of occurrences", flush=True)
    tok_bytes, merges, reused, n_words = train(pieces, args.ranks, args.min_count)
    t2 = time.time()
    if len(tok_bytes) != args.ranks:
        raise SystemExit(f"only {len(tok_bytes)} ranks could be trained")
    write_vocab(args.out, tok_bytes)
    print(f"trained {len(tok_bytes)} ranks ({merges} merges, {reused} merged into existing tokens) over "
          f"{n_words} unique pieces in {t2 - t1:.0f}s; wrote {args.out}/tiktoken.model, tokenizer_config.json")
    # sanity: the oracle loads it, and bytes round-trip
    enc = kimi_ref.make_encoding(args.out)
    sample = open(args.train, encoding="utf-8").read(200000)
    ids = kimi_ref.encode_text(enc, sample)
    assert enc.decode(ids) == sample
    # the training split (Python `regex`, V1) must cut where tiktoken's own splitter does: BPE over our
    # pieces one by one must give the same ids as tiktoken on the whole text
    import regex
    pat = regex.compile(kimi_ref.KIMI_PAT, flags=regex.V1)
    by_piece = [t for p in pat.findall(sample) for t in enc._encode_single_piece(p.encode("utf-8"))]
    if by_piece != enc.encode_ordinary(sample):
        raise SystemExit("the regex pre-tokenizer splits differently from tiktoken's")
    print(f"oracle check: {len(sample)} chars -> {len(ids)} ids ({len(sample.encode()) / len(ids):.2f} "
          f"bytes/token), round-trip ok; total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
