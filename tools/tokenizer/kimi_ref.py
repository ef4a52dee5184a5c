# Reference (oracle) encoder for tests: PyPI tiktoken + the Kimi split pattern + the long-input
# rules of Moonshot's tokenization_kimi.py. Test setup only; the engine never runs Python.
# Must not contain any of the C++ tokenizer's logic: it is the independent side of the comparison.
import base64
import json
import os

import tiktoken

# spec k3-architecture.md §4, alternatives joined by '|'
KIMI_PAT = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

MAX_CHUNK_CHARS = 400_000
MAX_RUN_CHARS = 25_000


def load_ranks(path):
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def make_encoding(vocab_dir):
    ranks = load_ranks(os.path.join(vocab_dir, "tiktoken.model"))
    specials = {}
    cfg_path = os.path.join(vocab_dir, "tokenizer_config.json")
    if os.path.exists(cfg_path):
        cfg = json.load(open(cfg_path, encoding="utf-8"))
        for k, v in cfg.get("added_tokens_decoder", {}).items():
            specials[v["content"]] = int(k)
    return tiktoken.Encoding("kimi-ref", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens=specials)


def split_runs(s, max_len):
    """Python tokenizer rule: cut runs of > max_len consecutive (str.isspace) space/non-space chars."""
    if not s:
        yield s
        return
    cur_len = 0
    cur_space = s[0].isspace()
    start = 0
    for i, ch in enumerate(s):
        sp = ch.isspace()
        if cur_space ^ sp:
            cur_len = 1
            cur_space = sp
        else:
            cur_len += 1
            if cur_len > max_len:
                yield s[start:i]
                start = i
                cur_len = 1
    yield s[start:]


def encode_text(enc, text):
    ids = []
    for i in range(0, len(text), MAX_CHUNK_CHARS):
        for sub in split_runs(text[i:i + MAX_CHUNK_CHARS], MAX_RUN_CHARS):
            ids.extend(enc.encode_ordinary(sub))
    return ids


def utf8_segments(data):
    """Split bytes into (is_valid, bytes) runs: maximal well-formed UTF-8 runs and invalid-byte runs."""
    s = data.decode("utf-8", errors="surrogateescape")
    out = []
    cur = []
    cur_valid = None
    for ch in s:
        valid = not (0xDC80 <= ord(ch) <= 0xDCFF)
        if valid != cur_valid and cur:
            out.append((cur_valid, cur))
            cur = []
        cur_valid = valid
        cur.append(ch)
    if cur:
        out.append((cur_valid, cur))
    res = []
    for valid, chars in out:
        if valid:
            res.append((True, "".join(chars).encode("utf-8")))
        else:
            res.append((False, bytes(ord(c) - 0xDC00 for c in chars)))
    return res


def encode_bytes(enc, data):
    """Engine policy for arbitrary bytes: valid runs encode as text; each invalid run is one BPE piece."""
    ids = []
    for valid, seg in utf8_segments(data):
        if valid:
            ids.extend(encode_text(enc, seg.decode("utf-8")))
        else:
            ids.extend(enc._encode_single_piece(seg))
    return ids
