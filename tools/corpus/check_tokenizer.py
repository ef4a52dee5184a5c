#!/usr/bin/env python3
# Checks that the engine's tokenizer (`k3 tokenize`) agrees with the tiktoken oracle
# (tools/tokenizer/kimi_ref.py: tiktoken + Kimi split pattern + long-input rules) on whole files.
#
#   build/corpus/venv/bin/python tools/corpus/check_tokenizer.py --k3 BUILD/bin/k3 [FILE ...]
#   (default vocab models/k3-nano, default file build/corpus/valid.txt)
# Exit 0 when every file gives identical ids, 1 otherwise (the first mismatch is printed).
import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tools", "tokenizer"))
import kimi_ref  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k3", required=True, help="path of the k3 binary")
    ap.add_argument("--vocab", default=os.path.join(REPO, "models/k3-nano"))
    ap.add_argument("files", nargs="*", default=[os.path.join(REPO, "build/corpus/valid.txt")])
    args = ap.parse_args()
    enc = kimi_ref.make_encoding(args.vocab)
    ok = True
    for path in args.files:
        t0 = time.time()
        r = subprocess.run([args.k3, "tokenize", "--vocab", args.vocab, "--file", path],
                           capture_output=True, check=False)
        t1 = time.time()
        if r.returncode != 0:
            print(f"{path}: k3 tokenize failed ({r.returncode}): {r.stderr.decode(errors='replace')}")
            ok = False
            continue
        got = [int(x) for x in r.stdout.split()]
        data = open(path, "rb").read()
        want = kimi_ref.encode_bytes(enc, data)
        t2 = time.time()
        if got == want:
            print(f"{path}: AGREE, {len(data)} bytes -> {len(want)} ids "
                  f"(k3 {t1 - t0:.1f}s, tiktoken oracle {t2 - t1:.1f}s)")
        else:
            ok = False
            i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            print(f"{path}: DIFFER: k3 {len(got)} ids, oracle {len(want)} ids; first difference at index {i}: "
                  f"k3 {got[i:i + 8]} oracle {want[i:i + 8]}; oracle text there: "
                  f"{enc.decode_bytes(want[max(0, i - 4):i + 8])!r}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
