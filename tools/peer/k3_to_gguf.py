#!/usr/bin/env python3
"""Convert a k3cpp checkpoint (Kimi K3 or Kimi Linear) to GGUF with llama.cpp's own converter.

Runs the vendored, unmodified `convert_hf_to_gguf.py` of llama.cpp (as shipped in the
llama-cpp-python sdist) in this process; it picks the converter class from config.json's
`architectures`:

* Kimi K3 (`KimiK3ForConditionalGeneration`, `conversion/kimi_k3.py`): handles the nested config,
  the `language_model.` prefix and repacks the compressed-tensors MXFP4 routed experts losslessly to
  ggml MXFP4;
* Kimi Linear (`KimiLinearForCausalLM`, `conversion/kimi_linear.py`, arch `kimi-linear`): the flat
  released Moonshot layout (what tools/gen/gen_kimi_linear.py writes); bf16 experts stacked into
  3-D tensors, `A_log` -> `-exp(A_log)`, `kv_b_proj` split into `k_b`/`v_b` (MLA absorption).

The only thing replaced is the vocabulary step: upstream builds it with
`AutoTokenizer(trust_remote_code=True)` (or a `tokenizer.json`), which needs Moonshot's
`tokenization_kimi.py`; our checkpoints ship only `tiktoken.model` + `tokenizer_config.json` (and
the random `mid1g`, `cpu-bench` and `kl-bench` checkpoints have no tokenizer at all). So
`KimiK3Model.set_vocab` and `KimiLinearModel.set_vocab` are replaced (monkey-patched at runtime,
the vendored files are untouched) by `k3cpp_set_vocab` below:

* `tiktoken.model` present: a byte-level BPE vocabulary (`gpt2` model, `kimi-k2` pre-tokenizer,
  which is K3's regex), tokens from the ranks, merges recovered from the ranks with the converter's
  own `QwenModel.bpe` helper, specials from `tokenizer_config.json`, eos from `config.json`;
* no tokenizer: tokenizer model `none` with `vocab_size` dummy tokens (llama.cpp's no-vocab mode;
  token ids are fed directly).

Usage (peer venv):  python tools/peer/k3_to_gguf.py CKPT_DIR OUT.gguf --llama-src DIR [--outtype bf16]
"""
from __future__ import annotations

import argparse
import base64
import json
import logging
import runpy
import sys
from pathlib import Path

log = logging.getLogger("k3_to_gguf")


def _read_tiktoken(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_text(encoding="ascii").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{n}: expected 'base64 rank'")
        ranks[base64.b64decode(parts[0])] = int(parts[1])
    return ranks


def k3cpp_set_vocab(self) -> None:  # replaces KimiK3Model.set_vocab and KimiLinearModel.set_vocab
    import gguf  # the vendored gguf-py (convert_hf_to_gguf puts it on sys.path)
    from conversion.qwen import QwenModel

    d = Path(self.dir_model)
    vocab_size = int(self.hparams["vocab_size"])
    tk = d / "tiktoken.model"
    if not tk.is_file():
        log.warning("%s: no tiktoken.model; writing a no-vocab GGUF (%d dummy tokens), feed ids directly",
                    d, vocab_size)
        self.gguf_writer.add_tokenizer_model("none")
        return

    ranks = _read_tiktoken(tk)
    specials: dict[str, int] = {}
    tcfg = d / "tokenizer_config.json"
    if tcfg.is_file():
        for k, v in json.loads(tcfg.read_text(encoding="utf-8")).get("added_tokens_decoder", {}).items():
            specials[v["content"]] = int(k)

    id_to_tok: dict[int, str] = {}
    merges: list[str] = []
    for tok, rank in ranks.items():
        id_to_tok[rank] = QwenModel.token_bytes_to_string(tok)
        if len(tok) == 1:
            continue
        merged = QwenModel.bpe(ranks, tok, max_rank=rank)
        if len(merged) == 2:
            merges.append(" ".join(map(QwenModel.token_bytes_to_string, merged)))
    special_ids = set()
    for content, i in specials.items():
        id_to_tok[i] = content
        special_ids.add(i)

    tokens: list[str] = []
    toktypes: list[int] = []
    for i in range(vocab_size):
        if i not in id_to_tok:
            tokens.append(f"[PAD{i}]")
            toktypes.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(id_to_tok[i])
            toktypes.append(gguf.TokenType.CONTROL if i in special_ids else gguf.TokenType.NORMAL)

    w = self.gguf_writer
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("kimi-k2")
    w.add_token_list(tokens)
    w.add_token_types(toktypes)
    w.add_token_merges(merges)
    gguf.SpecialVocab(d, load_merges=False).add_to_gguf(w)
    if (eos := self.hparams.get("eos_token_id")) is not None:
        w.add_eos_token_id(int(eos))
    log.info("vocab: %d tokens (%d ranks, %d specials), %d merges", len(tokens), len(ranks),
             len(special_ids), len(merges))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--llama-src", type=Path, required=True,
                    help="vendored llama.cpp source dir (has convert_hf_to_gguf.py, conversion/, gguf-py/)")
    ap.add_argument("--outtype", default="bf16", choices=["f32", "f16", "bf16", "q8_0", "auto"],
                    help="type of the non-MXFP4 tensors (default bf16 = the checkpoint's trunk dtype)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO)

    src = a.llama_src.resolve()
    conv = src / "convert_hf_to_gguf.py"
    if not conv.is_file():
        print(f"error: {conv} not found", file=sys.stderr)
        return 2
    sys.path.insert(0, str(src / "gguf-py"))
    sys.path.insert(0, str(src))
    import conversion.kimi_k3 as kimi_k3  # noqa: E402  (vendored)
    import conversion.kimi_linear as kimi_linear  # noqa: E402  (vendored)

    kimi_k3.KimiK3Model.set_vocab = k3cpp_set_vocab
    kimi_linear.KimiLinearModel.set_vocab = k3cpp_set_vocab
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_suffix(a.out.suffix + ".part")
    sys.argv = [str(conv), str(a.ckpt), "--outfile", str(tmp), "--outtype", a.outtype]
    runpy.run_path(str(conv), run_name="__main__")
    tmp.replace(a.out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
