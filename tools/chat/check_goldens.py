#!/usr/bin/env python3
"""Checks tools/chat/xtml.py (the Python XTML renderer the chat fine-tune data is rendered with)
against every reviewed golden conversation in tests/fixtures/chat/: NAME.json (the request) must
render to NAME.txt (review text: "<\\|" marks literal "<|" in ordinary text) and to the ids in
NAME.small.ids (tests/fixtures/tokenizer-small) and, when the full Kimi vocabulary is set up
(build/tokenizer-data/kimi, tools/tokenizer/setup_vocab.py), NAME.kimi.ids.
Exits 1 on any mismatch, printing where the two differ.

    build/corpus/venv/bin/python tools/chat/check_goldens.py [--kimi DIR]
"""
import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tools", "tokenizer"))
import kimi_ref  # noqa: E402
import xtml  # noqa: E402


def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b)) if len(a) != len(b) else -1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kimi", default=os.path.join(REPO, "build", "tokenizer-data", "kimi"))
    ap.add_argument("--dir", default=os.path.join(REPO, "tests", "fixtures", "chat"))
    a = ap.parse_args()
    vocabs = [("small", kimi_ref.make_encoding(os.path.join(REPO, "tests", "fixtures", "tokenizer-small")))]
    if os.path.exists(os.path.join(a.kimi, "tiktoken.model")):
        vocabs.append(("kimi", kimi_ref.make_encoding(a.kimi)))
    else:
        print(f"note: no Kimi vocabulary at {a.kimi}: *.kimi.ids not checked")
    bad = checked = 0
    files = sorted(glob.glob(os.path.join(a.dir, "*.json")))
    if not files:
        print("no goldens found")
        return 1
    for p in files:
        base = p[:-5]
        name = os.path.basename(base)
        req = json.load(open(p, encoding="utf-8"))
        segs = xtml.render(req["messages"], **xtml.resolve_options(req))
        want = open(base + ".txt", encoding="utf-8").read()
        got = xtml.review_text(segs)
        if got != want:
            i = first_diff(got, want)
            print(f"MISMATCH {name}.txt at char {i}:\n  python: {got[max(0, i - 60):i + 60]!r}\n"
                  f"  golden: {want[max(0, i - 60):i + 60]!r}")
            bad += 1
        checked += 1
        for tag, enc in vocabs:
            ip = f"{base}.{tag}.ids"
            if not os.path.exists(ip):
                continue
            want_ids = [int(t) for t in open(ip).read().split()]
            got_ids = xtml.segments_ids(enc, segs)
            checked += 1
            if got_ids != want_ids:
                i = first_diff(got_ids, want_ids)
                print(f"MISMATCH {name}.{tag}.ids at id {i}: python {got_ids[i:i + 8]} golden {want_ids[i:i + 8]}")
                bad += 1
    print(f"{checked - bad}/{checked} golden checks match ({len(files)} conversations)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
