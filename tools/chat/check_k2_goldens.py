#!/usr/bin/env python3
"""Checks the Kimi K2 chat goldens (tests/fixtures/chat-k2) against the chat template itself,
rendered with jinja2 the way Hugging Face transformers renders a checkpoint's chat_template:
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True), a `tojson` filter that is
json.dumps(ensure_ascii=False, default separators), and (as Kimi's tokenization_kimi.py does
before rendering) the tools' keys sorted at every depth. No code is shared with src/chat.

NAME.json (request: messages, tools, add_generation_prompt) must render to NAME.txt exactly, and
NAME.ids must be the ids tiktoken gives that text with tests/fixtures/tokenizer-k2-tiny (special
tokens allowed, as apply_chat_template(tokenize=True) encodes). --write-ids (re)writes NAME.ids.
Exits 1 on any mismatch.

    build/tokvenv/bin/python tools/chat/check_k2_goldens.py [--write-ids]
"""
import argparse
import glob
import json
import os
import sys

from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tools", "tokenizer"))
import kimi_ref  # noqa: E402

TOK_DIR = os.path.join(REPO, "tests", "fixtures", "tokenizer-k2-tiny")


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def deep_sort(o):
    if isinstance(o, dict):
        return {k: deep_sort(v) for k, v in sorted(o.items())}
    if isinstance(o, list):
        return [deep_sort(v) for v in o]
    return o


def template_text():
    cfg = json.load(open(os.path.join(TOK_DIR, "tokenizer_config.json"), encoding="utf-8"))
    t = cfg["chat_template"]
    src = open(os.path.join(HERE, "kimi_k2_chat_template.jinja"), encoding="utf-8").read()
    if t != src:
        raise SystemExit("tokenizer-k2-tiny's chat_template differs from tools/chat/kimi_k2_chat_template.jinja: "
                         "rerun tools/chat/make_k2_tokenizer.py")
    return t


def render(template, req):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    tools = req.get("tools") or None
    return env.from_string(template).render(messages=req["messages"], tools=deep_sort(tools) if tools else None,
                                            add_generation_prompt=req.get("add_generation_prompt", True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=os.path.join(REPO, "tests", "fixtures", "chat-k2"))
    ap.add_argument("--write-ids", action="store_true")
    a = ap.parse_args()
    template = template_text()
    enc = kimi_ref.make_encoding(TOK_DIR)
    files = sorted(glob.glob(os.path.join(a.dir, "*.json")))
    if not files:
        print("no goldens found")
        return 1
    bad = checked = 0
    for p in files:
        base = p[:-5]
        name = os.path.basename(base)
        req = json.load(open(p, encoding="utf-8"))
        got = render(template, req)
        want = open(base + ".txt", encoding="utf-8", newline="").read()
        checked += 1
        if got != want:
            i = next((k for k, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
            print(f"MISMATCH {name}.txt at char {i}:\n  jinja:  {got[max(0, i - 60):i + 60]!r}\n"
                  f"  golden: {want[max(0, i - 60):i + 60]!r}")
            bad += 1
            continue
        ids = enc.encode(got, allowed_special="all")
        ip = base + ".ids"
        if a.write_ids:
            open(ip, "w").write(" ".join(map(str, ids)) + "\n")
        checked += 1
        if not os.path.exists(ip) or [int(t) for t in open(ip).read().split()] != ids:
            print(f"MISMATCH {name}.ids (rerun with --write-ids after reviewing {name}.txt)")
            bad += 1
    print(f"{checked - bad}/{checked} K2 golden checks match ({len(files)} conversations)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
