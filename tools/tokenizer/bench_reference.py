#!/usr/bin/env python3
# Times the tiktoken reference (single thread) on the setup corpus, for the side-by-side with
# build/tests/tokenizer/k3_tok_bench. Usage: bench_reference.py DATA_DIR [repeats]. Measures only;
# prints every run's seconds (scripts/measure_tokenizer_throughput.sh takes the median and range).
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
    raw_s, kimi_s = [], []
    for _ in range(reps):
        t = time.perf_counter()
        for s in texts:
            enc.encode_ordinary(s)
        raw_s.append(round(time.perf_counter() - t, 4))
        t = time.perf_counter()
        for b in docs:
            kimi_ref.encode_bytes(enc, b)
        kimi_s.append(round(time.perf_counter() - t, 4))
    print(json.dumps({"bytes": nbytes, "tiktoken_encode_ordinary_seconds": raw_s,
                      "tiktoken_plus_kimi_rules_seconds": kimi_s}))


if __name__ == "__main__":
    main()
