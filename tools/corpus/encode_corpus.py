#!/usr/bin/env python3
# Encodes the K3-nano corpus into token ids for training:
#   build/corpus/train.u16, build/corpus/valid.u16   little-endian uint16 token ids
#   build/corpus/meta.json                           counts, vocab size, sha256 of every input/output
#
#   build/corpus/venv/bin/python tools/corpus/encode_corpus.py     (after build_corpus.sh, train_nano_vocab.py)
#
# The ids decode to exactly the bytes of train.txt / valid.txt. Documents are separated by the TEXT
# "\n\n\n" (two blank lines; build_corpus.py collapses blank-line runs inside documents, so it occurs only
# at boundaries); no special tokens are inserted. Each document is encoded together with the separator that
# follows it (the last one with the file's final "\n") by the tiktoken oracle of tools/tokenizer/kimi_ref.py
# (Kimi split pattern + long-input rules), so the separator may share a token with the document's final
# punctuation (the Kimi pattern joins ".\n\n\n"); no pre-token crosses a document boundary, which makes this
# equal to encoding the whole file except where kimi_ref's 400,000-character chunking would cut it.
import argparse
import array
import hashlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tools", "tokenizer"))
import kimi_ref  # noqa: E402

DOC_SEP = "\n\n\n"  # tools/corpus/build_corpus.py


def sha256_file(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def encode_file(enc, path):
    text = open(path, encoding="utf-8").read()
    parts = text.split(DOC_SEP)
    ids = array.array("H")
    for i, doc in enumerate(parts):
        ids.extend(kimi_ref.encode_text(enc, doc + DOC_SEP if i + 1 < len(parts) else doc))
    return text, parts, ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default=os.path.join(REPO, "build/corpus"))
    ap.add_argument("--vocab", default=os.path.join(REPO, "models/k3-nano"))
    args = ap.parse_args()
    import tiktoken
    enc = kimi_ref.make_encoding(args.vocab)
    n_ranks = sum(1 for line in open(os.path.join(args.vocab, "tiktoken.model"), "rb") if line.strip())
    vocab_size = enc.n_vocab
    if vocab_size > 65536:
        raise SystemExit("vocabulary does not fit uint16")
    meta = dict(
        description="K3-nano token ids: little-endian uint16, one stream per split; the ids decode to exactly "
                    "train.txt / valid.txt; documents are separated by the text \"\\n\\n\\n\" (no special tokens)",
        command="build/corpus/venv/bin/python tools/corpus/encode_corpus.py",
        dtype="uint16", byteorder="little", document_separator=DOC_SEP,
        tokenizer=os.path.relpath(args.vocab, REPO), n_ranks=n_ranks, vocab_size=vocab_size,
        tiktoken_model_sha256=sha256_file(os.path.join(args.vocab, "tiktoken.model")),
        tokenizer_config_sha256=sha256_file(os.path.join(args.vocab, "tokenizer_config.json")),
        encoder=f"tiktoken {tiktoken.__version__} + Kimi split pattern (tools/tokenizer/kimi_ref.py)",
        splits={},
    )
    for split in ("train", "valid"):
        t0 = time.time()
        src = os.path.join(args.corpus, split + ".txt")
        text, parts, ids = encode_file(enc, src)
        dt = time.time() - t0
        if enc.decode_bytes(ids.tolist()) != text.encode("utf-8"):
            raise SystemExit(f"{split}: ids do not decode to {src}")
        if sys.byteorder != "little":
            ids.byteswap()
        dst = os.path.join(args.corpus, split + ".u16")
        with open(dst, "wb") as f:
            ids.tofile(f)
        n_bytes = len(text.encode("utf-8"))
        meta["splits"][split] = dict(
            text=os.path.relpath(src, REPO), text_sha256=sha256_file(src), text_bytes=n_bytes,
            documents=len(parts), tokens=len(ids), bytes_per_token=round(n_bytes / len(ids), 4),
            ids=os.path.relpath(dst, REPO), ids_sha256=sha256_file(dst), max_id=max(ids),
            encode_seconds=round(dt, 1))
        print(f"{split}: {len(parts)} docs, {n_bytes} bytes -> {len(ids)} tokens "
              f"({n_bytes / len(ids):.3f} bytes/token) in {dt:.0f}s -> {dst}", flush=True)
    with open(os.path.join(args.corpus, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print("wrote", os.path.join(args.corpus, "meta.json"))


if __name__ == "__main__":
    main()
