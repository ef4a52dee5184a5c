#!/usr/bin/env python3
# Times the tiktoken reference (single thread) on the setup corpus, for the side-by-side with
# build/tests/tokenizer/k3_tok_bench. Usage: bench_reference.py DATA_DIR [repeats]. Measures only.
import json
import os
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kimi_ref  # noqa: E402


def main():
    d = sys.argv[1]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    enc = kimi_ref.make_encoding(os.path.join(d, "kimi"))
    raw = open(os.path.join(d, "corpus.bin"), "rb").read()
    docs, p = [], 0
    while p < len(raw):
        (n,) = struct.unpack_from("<I", raw, p)
        docs.append(raw[p + 4:p + 4 + n])
        p += 4 + n
    texts = [x.decode("utf-8", errors="replace") for x in docs]
    nbytes = sum(len(x) for x in docs)
    best_raw = best_kimi = 1e30
    for _ in range(reps):
        t = time.perf_counter()
        for s in texts:
            enc.encode_ordinary(s)
        best_raw = min(best_raw, time.perf_counter() - t)
        t = time.perf_counter()
        for b in docs:
            kimi_ref.encode_bytes(enc, b)
        best_kimi = min(best_kimi, time.perf_counter() - t)
    print(json.dumps({"bytes": nbytes, "tiktoken_encode_ordinary_s": round(best_raw, 4),
                      "tiktoken_MBps": round(nbytes / best_raw / 1e6, 2),
                      "tiktoken_plus_kimi_rules_s": round(best_kimi, 4),
                      "tiktoken_plus_kimi_rules_MBps": round(nbytes / best_kimi / 1e6, 2)}))


if __name__ == "__main__":
    main()
