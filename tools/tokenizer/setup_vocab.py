#!/usr/bin/env python3
# Test setup: rebuilds Moonshot's Kimi tiktoken ranks from the splintr-rs wheel, and writes a
# >= 10 MB mixed corpus (gathered from files on this machine) plus reference ids from tiktoken.
# Output goes to a build folder only (never committed). Usage: setup_vocab.py --out DIR
import argparse
import base64
import glob
import gettext
import gzip
import json
import os
import random
import struct
import sys
import time
import unicodedata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kimi_ref  # noqa: E402

N_RANKS = 163584


def extract_vocab(out_dir):
    import splintr
    tok = splintr.Tokenizer.from_pretrained("kimi_k3")
    vdir = os.path.join(out_dir, "kimi")
    os.makedirs(vdir, exist_ok=True)
    seen = set()
    with open(os.path.join(vdir, "tiktoken.model"), "wb") as f:
        for i in range(N_RANKS):
            b = bytes(tok.decode_token_bytes(i))
            if not b or b in seen:
                raise SystemExit(f"setup_vocab: rank {i} decodes to an empty/duplicate token")
            seen.add(b)
            f.write(base64.b64encode(b) + b" " + str(i).encode() + b"\n")
    added = {}
    for i in range(N_RANKS, N_RANKS + 256):
        added[str(i)] = {"content": tok.decode_with_special([i]), "special": True}
    cfg = {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "<|end_of_msg|>",
           "pad_token": "[PAD]", "unk_token": "[UNK]", "model_max_length": 1048576,
           "tokenizer_class": "TikTokenTokenizer", "chat_template": "k3-xtml (rendered natively)"}
    with open(os.path.join(vdir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=1)
    return vdir


def read(path, limit=None):
    try:
        with open(path, "rb") as f:
            data = f.read()
        if path.endswith(".gz"):
            data = gzip.decompress(data)
        return data[:limit] if limit else data
    except OSError:
        return b""


def mo_strings(path):
    try:
        with open(path, "rb") as f:
            t = gettext.GNUTranslations(f)
        return "\n".join(v for v in t._catalog.values() if isinstance(v, str))
    except Exception:
        return ""


def gather_corpus(seed=1234):
    """List of (name, bytes) documents, ~12 MB in all."""
    rng = random.Random(seed)
    docs = []

    def add_files(name, paths, budget, limit=200_000):
        total = 0
        for p in sorted(paths):
            if total >= budget:
                break
            d = read(p, limit)
            if d:
                docs.append((f"{name}:{p}", d))
                total += len(d)

    # English prose
    add_files("en", glob.glob("/usr/share/common-licenses/*") + glob.glob("/usr/share/doc/*/copyright"), 2_500_000)
    # code: C/C++ headers and Python stdlib
    add_files("cpp", glob.glob("/usr/include/c++/12/bits/*.h"), 1_500_000)
    add_files("py", glob.glob("/usr/lib/python3.11/*.py"), 1_500_000)
    # many languages (vim tutors), including legacy encodings = invalid UTF-8 input
    add_files("tutor", glob.glob("/usr/share/vim/vim90/tutor/tutor.*"), 2_000_000)
    # Chinese / Japanese / Korean UI strings from gettext catalogs
    cjk = []
    for loc in ["zh_CN", "zh_TW", "ja", "ko", "zh_HK"]:
        for p in sorted(glob.glob(f"/usr/share/locale/{loc}/LC_MESSAGES/*.mo")):
            cjk.append(mo_strings(p))
    cjk_text = "\n".join(c for c in cjk if c)
    cjk_bytes = cjk_text.encode("utf-8")[:2_500_000]
    for i in range(0, len(cjk_bytes), 300_000):
        docs.append((f"cjk:{i}", cjk_bytes[i:i + 300_000]))
    # raw .mo binaries: headers are not UTF-8
    add_files("mo-raw", glob.glob("/usr/share/locale/zh_CN/LC_MESSAGES/*.mo"), 600_000, 60_000)

    # synthetic: emoji, long whitespace runs (past the 25,000-char rule), digits, mixed scripts
    emoji = [chr(c) for c in range(0x1F300, 0x1FAFF) if unicodedata.category(chr(c)) == "So"]
    emoji += ["\u2764\ufe0f", "\U0001F468\u200d\U0001F469\u200d\U0001F467", "\U0001F44D\U0001F3FD", "\U0001F1EF\U0001F1F5"]
    parts = []
    for _ in range(20000):
        k = rng.random()
        if k < 0.3:
            parts.append("".join(rng.choice(emoji) for _ in range(rng.randint(1, 6))))
        elif k < 0.5:
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 15))))
        elif k < 0.7:
            parts.append(rng.choice([" ", "\t", "\n", "\r\n", "  ", "\u3000", "\xa0", "\x0b", "\x85"]) * rng.randint(1, 40))
        else:
            parts.append(rng.choice(["Hello", "world's", "DON'T", "中文", "日本語です", "한국어", "Привет",
                                     "ǅemal", "ſ's", "x\u0301y", "🙂中", "'re", "'LL"]))
    docs.append(("synthetic:mixed", "".join(parts).encode("utf-8")))
    docs.append(("synthetic:long-space", (" " * 30_000 + "end\n" + "\n" * 26_000 + "x" * 60_000 + " tail").encode()))
    docs.append(("synthetic:long-digits", ("1234567890" * 50_000).encode()))
    docs.append(("synthetic:han-run", ("汉字" * 220_000).encode()))
    return docs


def fuzz_strings(seed=99, n=20000):
    rng = random.Random(seed)
    alphabet = (list("abcXYZ019 '\"\t\n\r\x0b\x0c.,!?-_") + list("sStTdDmMlLrReEvV") +
                ["中", "文", "々", "〇", "、", "。", "ー", "カ", "な", "한", "ǅ", "ʰ", "\u0301", "\u0308", "ſ",
                 "٣", "Ⅻ", "½", "\xa0", "\u3000", "\x85", "\u2028", "\x1c", "🙂", "\U0001F468\u200d", "\ufe0f",
                 "ß", "İ", "Ω", "é", "\u200b", "\ufeff", "𝔘", "😀", "\x00", "\x7f"])
    out = []
    for _ in range(n):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        b = s.encode("utf-8")
        if rng.random() < 0.1 and b:
            pos = rng.randint(0, len(b))
            b = b[:pos] + bytes([rng.choice([0x80, 0xbf, 0xc0, 0xe4, 0xed, 0xf5, 0xff, 0xf0])]) + b[pos:]
        out.append(b)
    return out


def write_records(path, items):
    with open(path, "wb") as f:
        for it in items:
            f.write(struct.pack("<I", len(it)))
            f.write(it)


def write_ids(path, id_lists):
    with open(path, "wb") as f:
        for ids in id_lists:
            f.write(struct.pack("<I", len(ids)))
            f.write(struct.pack(f"<{len(ids)}I", *ids))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    vdir = extract_vocab(args.out)
    enc = kimi_ref.make_encoding(vdir)
    goldens = {"Hello world": [19180, 2695], "Hello, world!": [19180, 11, 2695, 0], "你好世界": [33845, 2243],
               "1234567890": [6694, 12972, 16242, 15], "中文English混合": [16717, 44372, 13935],
               "The capital of France is": [1008, 10484, 318, 15383, 387]}
    for t, want in goldens.items():
        got = kimi_ref.encode_text(enc, t)
        if got != want:
            raise SystemExit(f"setup_vocab: rebuilt vocabulary fails golden {t!r}: {got} != {want}")

    docs = gather_corpus()
    data = [d for _, d in docs]
    t0 = time.perf_counter()
    ids = [kimi_ref.encode_bytes(enc, d) for d in data]
    t_ref = time.perf_counter() - t0
    # raw tiktoken (no chunking wrapper) on the valid-UTF-8 text, for the throughput comparison
    texts = [d.decode("utf-8", errors="replace") for d in data]
    t0 = time.perf_counter()
    for t in texts:
        enc.encode_ordinary(t)
    t_raw = time.perf_counter() - t0
    write_records(os.path.join(args.out, "corpus.bin"), data)
    write_ids(os.path.join(args.out, "corpus.ids"), ids)
    with open(os.path.join(args.out, "corpus.names.txt"), "w") as f:
        f.write("\n".join(n for n, _ in docs) + "\n")
    fz = fuzz_strings()
    write_records(os.path.join(args.out, "fuzz.bin"), fz)
    write_ids(os.path.join(args.out, "fuzz.ids"), [kimi_ref.encode_bytes(enc, b) for b in fz])
    nbytes = sum(len(d) for d in data)
    stats = {"corpus_bytes": nbytes, "corpus_docs": len(data), "corpus_tokens": sum(len(i) for i in ids),
             "tiktoken_version": __import__("tiktoken").__version__,
             "ref_seconds_with_kimi_rules": round(t_ref, 3), "ref_MBps_with_kimi_rules": round(nbytes / t_ref / 1e6, 2),
             "tiktoken_encode_ordinary_seconds": round(t_raw, 3), "tiktoken_MBps": round(nbytes / t_raw / 1e6, 2)}
    with open(os.path.join(args.out, "reference_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
