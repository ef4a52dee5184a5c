#!/usr/bin/env python3
# Generator of src/tokenizer/unicode_props_data.cpp: the compiled-in code-point property table of the
# Kimi pre-tokenizer (flags of src/tokenizer/unicode_props.h) at Unicode 16.0.0, the version of the
# tables in tiktoken 0.14.0's regex engine (the reference encoder). Nothing is read at build or run
# time; the engine never runs Python.
#
# Inputs, all pinned (tools/requirements.txt, tools/tokenizer/requirements.txt):
#   * unicodedata2==16.0.0          General_Category (\p{L}, \p{N}, \p{Lu}...) and Bidi_Class
#                                   (Python's str.isspace rule)
#   * unicodedataplus==16.0.0.post1 Script (\p{Han} is Script=Han in the reference engine, not
#                                   Script_Extensions)
#   * White_Space: the 25 code points of PropList-16.0.0.txt, listed below (unchanged since Unicode
#     6.3); cross-checked here against unicodedataplus' Sentence_Break (Sp, Sep, CR, LF), which UAX #29
#     derives from White_Space.
#   The PyPI files the committed output was generated from (sha256):
#     unicodedata2-16.0.0-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
#       38e5effb78231cbc790ac9417d07735b7a61686ecd0f5d7464efd6950944f9b3 (sdist unicodedata2-16.0.0.tar.gz
#       05488d6592b59cd78b61ec37d38725416b2df62efafa6a0d63a631b27aa474fc)
#     unicodedataplus-16.0.0.post1-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
#       342a5f730a092d90bcaf46fd514aeea920705950b243b2fb09d69a633d2ba17b (sdist unicodedataplus-16.0.0.post1.tar.gz
#       f8cd342d91c73b512c229976a82aeb7e448517969d611433a9ea825dc62fed84)
# tools/tokenizer/unicode_reference.py checks the output against tiktoken itself, every code point.
#
# Usage: PY tools/tokenizer/gen_unicode_props.py [--out src/tokenizer/unicode_props_data.cpp] [--check]
# --check: exit 1 when the file on disk differs from what would be written (nothing is written).
import argparse
import importlib.metadata
import os
import sys

import unicodedata2
import unicodedataplus

UNICODE_VERSION = "16.0.0"
PINS = {"unicodedata2": "16.0.0", "unicodedataplus": "16.0.0.post1"}
BLOCK = 256  # code points per second-level block (the header's lookup assumes 256)

# Flag bits, as in src/tokenizer/unicode_props.h
HAN, LETTER, NUMBER, UPPER, LOWER, SPACE, CRLF, PYSPACE = 1, 2, 4, 8, 16, 32, 64, 128

# PropList-16.0.0.txt, property White_Space (https://www.unicode.org/Public/16.0.0/ucd/PropList.txt)
WHITE_SPACE = ([0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680] + list(range(0x2000, 0x200B)) +
               [0x2028, 0x2029, 0x202F, 0x205F, 0x3000])

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(REPO, "src", "tokenizer", "unicode_props_data.cpp")


def check_inputs():
    for name, want in PINS.items():
        have = importlib.metadata.version(name)
        if have != want:
            sys.exit(f"gen_unicode_props: {name} {have} is installed, the pin is {want}")
    for mod in (unicodedata2, unicodedataplus):
        if mod.unidata_version != UNICODE_VERSION:
            sys.exit(f"gen_unicode_props: {mod.__name__} has Unicode {mod.unidata_version}, want {UNICODE_VERSION}")
    ws = set(WHITE_SPACE)
    if len(ws) != 25:
        sys.exit("gen_unicode_props: the White_Space list must have 25 code points")
    for cp in range(0x110000):
        ch = chr(cp)
        if unicodedata2.category(ch) != unicodedataplus.category(ch):
            sys.exit(f"gen_unicode_props: the two packages disagree on the category of U+{cp:04X}")
        from_sb = unicodedataplus.sentence_break(ch) in ("Sp", "Sep", "CR", "LF")
        if from_sb != (cp in ws):
            sys.exit(f"gen_unicode_props: White_Space list and Sentence_Break disagree on U+{cp:04X}")


def flags(cp, ws):
    ch = chr(cp)
    gc = unicodedata2.category(ch)
    han = unicodedataplus.script(ch) == "Han"
    f = 0
    if han:
        f |= HAN
    if gc[0] == "L":
        f |= LETTER
    if gc[0] == "N":
        f |= NUMBER
    if not han and (gc in ("Lu", "Lt", "Lm", "Lo") or gc[0] == "M"):
        f |= UPPER
    if not han and (gc in ("Ll", "Lm", "Lo") or gc[0] == "M"):
        f |= LOWER
    if cp in ws:
        f |= SPACE
    if cp in (0x0A, 0x0D):
        f |= CRLF
    # CPython's str.isspace (Tools/unicode/makeunicodedata.py): Bidi_Class WS, B or S, or category Zs
    if unicodedata2.bidirectional(ch) in ("WS", "B", "S") or gc == "Zs":
        f |= PYSPACE
    return f


def build():
    ws = set(WHITE_SPACE)
    table = [flags(cp, ws) for cp in range(0x110000)]
    blocks, index, stage1 = [], {}, []
    for b in range(0x110000 // BLOCK):
        blk = bytes(table[b * BLOCK:(b + 1) * BLOCK])
        if blk not in index:
            index[blk] = len(blocks)
            blocks.append(blk)
        stage1.append(index[blk])
    if len(blocks) > 256:
        sys.exit("gen_unicode_props: more than 256 distinct blocks; widen the first stage to uint16_t")
    return table, stage1, blocks


def c_rows(values, per_row=20, indent="    "):
    rows = []
    for i in range(0, len(values), per_row):
        rows.append(indent + ", ".join(str(v) for v in values[i:i + per_row]) + ",")
    return "\n".join(rows)


def render(table, stage1, blocks):
    counts = {name: sum(1 for f in table if f & bit) for name, bit in
              [("Han", HAN), ("L", LETTER), ("N", NUMBER), ("upper class", UPPER), ("lower class", LOWER),
               ("White_Space", SPACE), ("str.isspace", PYSPACE)]}
    out = [
        "// GENERATED FILE - do not edit. Regenerate with (PY: build/venv/bin/python of tools/setup_venv.sh, or",
        "// build/tokvenv/bin/python of scripts/test.sh, both with the pins of tools/requirements.txt):",
        "//   PY tools/tokenizer/gen_unicode_props.py --out src/tokenizer/unicode_props_data.cpp",
        f"// Unicode {UNICODE_VERSION}: General_Category and Bidi_Class from unicodedata2 {PINS['unicodedata2']},",
        f"// Script from unicodedataplus {PINS['unicodedataplus']}, White_Space from PropList-{UNICODE_VERSION}.txt "
        "(listed in the generator).",
        "// Flags per code point as in unicode_props.h; two-level table: kPropStage1[cp >> 8] picks one of",
        f"// {len(blocks)} distinct 256-entry blocks of kPropStage2 ({len(stage1) + len(blocks) * BLOCK} bytes in all).",
        "// Code points with each flag: " + ", ".join(f"{k} {v}" for k, v in list(counts.items())[:4]) + ",",
        "//   " + ", ".join(f"{k} {v}" for k, v in list(counts.items())[4:]) + ".",
        '#include "tokenizer/unicode_props.h"',
        "",
        "namespace k3::tok::detail {",
        "",
        "// clang-format off",
        f'const char kUnicodeVersion[] = "{UNICODE_VERSION}";',
        "",
        "const uint8_t kPropStage1[0x110000 >> 8] = {",
        c_rows(stage1),
        "};",
        "",
        f"alignas(64) const uint8_t kPropStage2[{len(blocks)} * 256] = {{",
    ]
    for i, blk in enumerate(blocks):
        out.append(f"    // block {i}")
        out.append(c_rows(list(blk)))
    out += ["};", "// clang-format on", "", "}  // namespace k3::tok::detail", ""]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    check_inputs()
    text = render(*build())
    if args.check:
        old = open(args.out, encoding="utf-8").read() if os.path.exists(args.out) else None
        if old != text:
            print(f"gen_unicode_props: {args.out} is out of date")
            return 1
        print(f"gen_unicode_props: {args.out} is up to date")
        return 0
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"gen_unicode_props: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
