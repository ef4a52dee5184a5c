#!/usr/bin/env python3
"""Writes tests/fixtures/tokenizer-k2-tiny: a small tokenizer with the Kimi K2 chat special tokens,
small enough for tests/fixtures/kl-tiny (vocabulary 512), so `k3 chat`/`k3 serve` can be tested on a
Kimi Linear checkpoint with `--tokenizer tests/fixtures/tokenizer-k2-tiny`.

- tiktoken.model: the first 494 ranks of tests/fixtures/tokenizer-small (the first N ranks of a BPE
  vocabulary are a BPE vocabulary: every merge's parts rank lower than the merge).
- tokenizer_config.json: the K2 special tokens at 494 + (their offset from 163584 in Kimi's released
  tokenizer: [BOS] 0, [EOS] 1, <|im_end|> 2, <|im_user|> 3, <|im_assistant|> 4, ... <|im_middle|> 17),
  and `chat_template`: tools/chat/kimi_k2_chat_template.jinja (Kimi K2's published template,
  docs/chat-k2.md), as a released checkpoint carries it.

    python3 tools/chat/make_k2_tokenizer.py [--check]
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SRC = os.path.join(REPO, "tests", "fixtures", "tokenizer-small", "tiktoken.model")
OUT = os.path.join(REPO, "tests", "fixtures", "tokenizer-k2-tiny")
N_RANKS = 494
# offsets from 163584 in Kimi K2 / Kimi Linear's tokenizer_config.json added_tokens_decoder
K2_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
               6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
               11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
               14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>"}


def files():
    lines = open(SRC, encoding="ascii").read().splitlines()
    ranks = [ln for ln in lines if ln.strip()]
    assert [int(ln.split()[1]) for ln in ranks[:N_RANKS]] == list(range(N_RANKS)), "tokenizer-small ranks are not 0..N-1"
    model = "\n".join(ranks[:N_RANKS]) + "\n"
    template = open(os.path.join(HERE, "kimi_k2_chat_template.jinja"), encoding="utf-8").read()
    cfg = {
        "added_tokens_decoder": {str(N_RANKS + k): {"content": v, "special": True} for k, v in sorted(K2_SPECIALS.items())},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "chat_template": template,
    }
    return {"tiktoken.model": model, "tokenizer_config.json": json.dumps(cfg, indent=1, ensure_ascii=False) + "\n"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    a = ap.parse_args()
    bad = 0
    for name, text in files().items():
        p = os.path.join(OUT, name)
        if a.check:
            if not os.path.exists(p) or open(p, encoding="utf-8").read() != text:
                print(f"MISMATCH {p}: rerun tools/chat/make_k2_tokenizer.py")
                bad += 1
        else:
            os.makedirs(OUT, exist_ok=True)
            with open(p, "w", encoding="utf-8", newline="\n") as f:
                f.write(text)
    if a.check and not bad:
        print("tokenizer-k2-tiny matches its generator")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
