#!/usr/bin/env python3
# Computes the token ids of each reviewed chat golden (tests/fixtures/chat/*.txt) with the tiktoken
# oracle, independently of the C++ renderer: markers become special ids, everything else is encoded
# with specials disallowed ("<\|" in a golden marks literal "<|" user text). Writes *.small.ids and,
# when --kimi DIR is given, *.kimi.ids. Usage: chat_golden_ids.py [--kimi BUILD/tokenizer-data/kimi]
import argparse
import glob
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kimi_ref  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MARKERS = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"]


def golden_ids(enc, text):
    ids = []
    parts = re.split("(" + "|".join(re.escape(m) for m in MARKERS) + ")", text)
    for p in parts:
        if p in MARKERS:
            ids.append(enc._special_tokens[p])
        elif p:
            ids.extend(kimi_ref.encode_text(enc, p.replace("<\\|", "<|")))
    return ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kimi", default=None)
    args = ap.parse_args()
    vocabs = [("small", os.path.join(ROOT, "tests/fixtures/tokenizer-small"))]
    if args.kimi:
        vocabs.append(("kimi", args.kimi))
    for tag, vdir in vocabs:
        enc = kimi_ref.make_encoding(vdir)
        for path in sorted(glob.glob(os.path.join(ROOT, "tests/fixtures/chat/*.txt"))):
            text = open(path, encoding="utf-8").read()
            ids = golden_ids(enc, text)
            with open(path[:-4] + f".{tag}.ids", "w") as f:
                f.write(" ".join(map(str, ids)) + "\n")
            print(tag, os.path.basename(path), len(ids))


if __name__ == "__main__":
    main()
