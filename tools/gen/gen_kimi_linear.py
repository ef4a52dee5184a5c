#!/usr/bin/env python3
"""Write a random Kimi Linear checkpoint in the released Moonshot layout (model_type kimi_linear).

Layout (see docs/kimi-linear.md): flat config.json with a `linear_attn_config` sub-dict (1-indexed
kda_layers / full_attn_layers), `model.layers.N.self_attn.*` for KDA and MLA (no q LoRA),
`model.layers.0.mlp.*` (dense), `model.layers.N.block_sparse_moe.{gate.weight,
gate.e_score_correction_bias, experts.J.w1/w2/w3, shared_experts.*}`, `lm_head.weight`; sharded
safetensors + model.safetensors.index.json.

Presets:
  kl-tiny   6 layers (KDA at 1,2,4,5; MLA at 3,6 one-based; dense MLP in layer 0), hidden 64,
            KDA 4x16, MLA 4 heads, 8 experts top-3 + 1 shared, vocab 512, 2 shards, ~1 MB.
            The committed fixture tests/fixtures/kl-tiny (tools/gen/make_kl_fixtures.py).
  kl-bench  shrunk model for CPU benchmarks (~2.6 GB bf16): hidden 1536, 8 layers (MLA at 4, 8),
            KDA 12x128, MLA 12 heads, 32 experts top-8 + 1 shared, vocab 163840. Never commit.
  kl-full   the released 48B-A3B shapes (27 layers, hidden 2304, 256 experts, vocab 163840), bf16,
            random, ~98 GB, written one layer per shard. Only when asked; `--dry-run` prints the
            parameter counts and bytes without writing anything.

dtype (--dtype, default bf16): bf16 = BF16 matrices/norms/conv weights and F32 for A_log, dt_bias,
the router weight and e_score_correction_bias (what transformers keeps in fp32); f32 = all F32.

Every tensor is drawn from its own numpy Generator seeded by (seed, crc32(name)), so a
(preset, seed, dtype) triple always gives byte-identical files, independent of sharding.
`--torch-device cuda` draws from torch's generator on the GPU instead (kl-full in about a minute on
the GPU machine rather than many minutes of numpy): also seeded per tensor, but its bytes depend on
the torch version and device, so it is only for benchmark checkpoints.

Usage:
  python tools/gen/gen_kimi_linear.py --preset kl-tiny --seed 1 --out /tmp/kl-tiny
  python tools/gen/gen_kimi_linear.py --preset kl-full --dry-run
  python tools/gen/gen_kimi_linear.py --preset kl-bench --out /data/kl-bench
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import zlib
from typing import Dict, Iterator, List, Tuple

import numpy as np
import torch
from safetensors.torch import save_file

PRESETS: Dict[str, dict] = {
    "kl-tiny": dict(
        hidden=64, layers=6, full_attn=[3, 6],
        kda_heads=4, kda_dim=16, conv=4,
        mla_heads=4, kv_lora=32, nope=16, rope=8, v=16,
        dense_inter=96, first_dense=1,
        experts=8, topk=3, shared=1, moe_inter=32,
        vocab=512, scaling=2.446, rms_eps=1e-5, shards=2,
    ),
    "kl-bench": dict(
        hidden=1536, layers=8, full_attn=[4, 8],
        kda_heads=12, kda_dim=128, conv=4,
        mla_heads=12, kv_lora=512, nope=128, rope=64, v=128,
        dense_inter=4096, first_dense=1,
        experts=32, topk=8, shared=1, moe_inter=640,
        vocab=163840, scaling=2.446, rms_eps=1e-5, shards=8,
    ),
    "kl-full": dict(
        hidden=2304, layers=27, full_attn=[4, 8, 12, 16, 20, 24, 27],
        kda_heads=32, kda_dim=128, conv=4,
        mla_heads=32, kv_lora=512, nope=128, rope=64, v=128,
        dense_inter=9216, first_dense=1,
        experts=256, topk=8, shared=1, moe_inter=1024,
        vocab=163840, scaling=2.446, rms_eps=1e-5, shards=28,
    ),
}

BOS, EOS, PAD = 163584, 163586, 163839  # the released ids (Kimi K2 tokenizer)


def make_config(p: dict, dtype: str) -> dict:
    """config.json as Moonshot ships it (flat, linear_attn_config sub-dict, 1-indexed layer lists)."""
    L = p["layers"]
    kda = [i for i in range(1, L + 1) if i not in p["full_attn"]]
    big_vocab = p["vocab"] > PAD
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_kimi.KimiLinearConfig",
            "AutoModel": "modeling_kimi.KimiLinearModel",
            "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM",
        },
        "bos_token_id": BOS if big_vocab else 1,
        "dtype": {"bf16": "bfloat16", "f32": "float32"}[dtype],
        "eos_token_id": EOS if big_vocab else 2,
        "first_k_dense_replace": p["first_dense"],
        "head_dim": p["hidden"] // p["mla_heads"],  # legacy field of the release (unused)
        "hidden_act": "silu",
        "hidden_size": p["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": p["dense_inter"],
        "kv_lora_rank": p["kv_lora"],
        "linear_attn_config": {
            "full_attn_layers": list(p["full_attn"]),
            "head_dim": p["kda_dim"],
            "kda_layers": kda,
            "num_heads": p["kda_heads"],
            "short_conv_kernel_size": p["conv"],
        },
        "mla_use_nope": True,
        "model_max_length": 1048576,
        "model_type": "kimi_linear",
        "moe_intermediate_size": p["moe_inter"],
        "moe_layer_freq": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "num_attention_heads": p["mla_heads"],
        "num_expert_group": 1,
        "num_experts": p["experts"],
        "num_experts_per_token": p["topk"],
        "num_hidden_layers": L,
        "num_key_value_heads": p["mla_heads"],
        "num_nextn_predict_layers": 0,
        "num_shared_experts": p["shared"],
        "pad_token_id": PAD if big_vocab else 0,
        "q_lora_rank": None,
        "qk_nope_head_dim": p["nope"],
        "qk_rope_head_dim": p["rope"],
        "rms_norm_eps": p["rms_eps"],
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "routed_scaling_factor": p["scaling"],
        "tie_word_embeddings": False,
        "topk_group": 1,
        "use_cache": True,
        "use_grouped_topk": True,
        "v_head_dim": p["v"],
        "vocab_size": p["vocab"],
    }


# --------------------------------------------------------------------------------------------
# tensor inventory: (name, shape, kind) in a fixed order; `kind` selects the init


def inventory(p: dict) -> Iterator[Tuple[str, Tuple[int, ...], str]]:
    H, V = p["hidden"], p["vocab"]
    Hk, D, K = p["kda_heads"], p["kda_dim"], p["conv"]
    W = Hk * D
    Nh, R, nope, rope, vd = p["mla_heads"], p["kv_lora"], p["nope"], p["rope"], p["v"]
    E, I, S = p["experts"], p["moe_inter"], p["shared"] * p["moe_inter"]
    yield "model.embed_tokens.weight", (V, H), "embed"
    for i in range(p["layers"]):
        pre = f"model.layers.{i}."
        yield pre + "input_layernorm.weight", (H,), "norm"
        a = pre + "self_attn."
        if (i + 1) in p["full_attn"]:
            yield a + "q_proj.weight", (Nh * (nope + rope), H), "linear"
            yield a + "kv_a_proj_with_mqa.weight", (R + rope, H), "linear"
            yield a + "kv_a_layernorm.weight", (R,), "norm"
            yield a + "kv_b_proj.weight", (Nh * (nope + vd), R), "linear"
            yield a + "o_proj.weight", (H, Nh * vd), "linear"
        else:
            for n in ("q", "k", "v"):
                yield a + f"{n}_proj.weight", (W, H), "linear"
            for n in ("q", "k", "v"):
                yield a + f"{n}_conv1d.weight", (W, 1, K), "conv"
            yield a + "A_log", (1, 1, Hk, 1), "A_log"
            yield a + "dt_bias", (W,), "dt_bias"
            yield a + "f_a_proj.weight", (D, H), "linear"
            yield a + "f_b_proj.weight", (W, D), "linear"
            yield a + "b_proj.weight", (Hk, H), "linear"
            yield a + "g_a_proj.weight", (D, H), "linear"
            yield a + "g_b_proj.weight", (W, D), "linear"
            yield a + "o_norm.weight", (D,), "norm"
            yield a + "o_proj.weight", (H, W), "linear"
        yield pre + "post_attention_layernorm.weight", (H,), "norm"
        if i < p["first_dense"]:
            m = pre + "mlp."
            yield m + "gate_proj.weight", (p["dense_inter"], H), "linear"
            yield m + "up_proj.weight", (p["dense_inter"], H), "linear"
            yield m + "down_proj.weight", (H, p["dense_inter"]), "linear"
        else:
            m = pre + "block_sparse_moe."
            yield m + "gate.weight", (E, H), "router"
            yield m + "gate.e_score_correction_bias", (E,), "score_bias"
            for j in range(E):
                yield m + f"experts.{j}.w1.weight", (I, H), "linear"
                yield m + f"experts.{j}.w2.weight", (H, I), "linear"
                yield m + f"experts.{j}.w3.weight", (I, H), "linear"
            yield m + "shared_experts.gate_proj.weight", (S, H), "linear"
            yield m + "shared_experts.up_proj.weight", (S, H), "linear"
            yield m + "shared_experts.down_proj.weight", (H, S), "linear"
    yield "model.norm.weight", (H,), "norm"
    yield "lm_head.weight", (V, H), "linear"


F32_KINDS = {"A_log", "dt_bias", "router", "score_bias"}


def _numpy_draws(name: str, seed: int):
    """(normal(shape), uniform(lo, hi, shape)) from a numpy Generator seeded by (seed, crc32(name))."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return (lambda shape: torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)),
            lambda lo, hi, shape: torch.from_numpy(rng.uniform(lo, hi, size=shape)))  # float64, as before


def _torch_draws(name: str, seed: int, device: str):
    """The same two draws from torch's generator on `device` (e.g. cuda: ~100x faster for kl-full; the
    bytes depend on the torch version and the device, so never used for committed fixtures)."""
    g = torch.Generator(device=device)
    g.manual_seed((seed << 32) ^ zlib.crc32(name.encode()))
    return (lambda shape: torch.randn(shape, generator=g, device=device, dtype=torch.float32),
            lambda lo, hi, shape: lo + (hi - lo) * torch.rand(shape, generator=g, device=device,
                                                            dtype=torch.float64))


def make_tensor(name: str, shape: Tuple[int, ...], kind: str, seed: int, dtype: str,
                torch_device: str = "") -> torch.Tensor:
    normal, uniform = _torch_draws(name, seed, torch_device) if torch_device else _numpy_draws(name, seed)
    if kind == "embed":
        a = normal(shape)
    elif kind == "linear":
        a = normal(shape) * (1.0 / math.sqrt(shape[-1]))
    elif kind == "norm":
        a = 1.0 + 0.1 * normal(shape)
    elif kind == "conv":
        # depthwise taps, the current token (last tap) weighted most
        a = normal(shape) * 0.3
        a[..., -1] += 0.7
    elif kind == "A_log":  # FLA init: A ~ U(1, 16)
        a = torch.log(uniform(1.0, 16.0, shape))
    elif kind == "dt_bias":  # inverse softplus of dt ~ logU(1e-3, 1e-1), as FLA/transformers init
        dt = torch.exp(uniform(math.log(1e-3), math.log(1e-1), shape))
        a = dt + torch.log(-torch.expm1(-dt))
    elif kind == "router":
        a = normal(shape) * (1.0 / math.sqrt(shape[-1]))
    elif kind == "score_bias":  # big enough to change the top-k choice of some tokens
        a = uniform(-0.1, 0.1, shape)
    else:
        raise ValueError(kind)
    if dtype == "f32" or kind in F32_KINDS:
        return a.to(torch.float32).cpu().contiguous()
    return a.to(torch.bfloat16).cpu().contiguous()


def shard_of(name: str, p: dict) -> int:
    """0-based shard index: layers evenly over the shards; embed in the first, norm/head in the last."""
    n = p["shards"]
    if n == 1:
        return 0
    if name.startswith("model.layers."):
        li = int(name.split(".")[2])
        if n >= p["layers"] + 1:  # kl-full: one layer per shard (embed with layer 0, norm+head last)
            return li
        return li * n // p["layers"]
    return 0 if "embed_tokens" in name else n - 1


def counts(p: dict) -> dict:
    """Total and per-token-active parameter counts (active: top-k of the routed experts)."""
    total = active = 0
    routed_one = 3 * p["hidden"] * p["moe_inter"]
    for name, shape, _ in inventory(p):
        n = int(np.prod(shape))
        total += n
        if ".experts." not in name:
            active += n
    n_moe = p["layers"] - p["first_dense"]
    active += n_moe * p["topk"] * routed_one
    emb = p["vocab"] * p["hidden"]
    return {"total": total, "active": active, "active_without_embedding": active - emb}


def dry_run(p: dict, dtype: str) -> None:
    c = counts(p)
    nbytes = 0
    for name, shape, kind in inventory(p):
        es = 4 if (dtype == "f32" or kind in F32_KINDS) else 2
        nbytes += int(np.prod(shape)) * es
    print(f"parameters: total {c['total']:,} ({c['total'] / 1e9:.3f} B), active per token "
          f"{c['active']:,} ({c['active'] / 1e9:.3f} B; {c['active_without_embedding'] / 1e9:.3f} B "
          f"without the input embedding)")
    print(f"bytes ({dtype}): {nbytes:,} ({nbytes / 2**30:.2f} GiB, {nbytes / 1e9:.2f} GB), "
          f"{p['shards']} shards")


def _write_shard(work) -> Tuple[str, List[Tuple[str, int]]]:
    """One shard in memory at a time (kl-full: ~3.6 GB per MoE layer); its file name and tensor sizes."""
    out, s, n, items, seed, dtype, torch_device = work
    tensors = {name: make_tensor(name, shape, kind, seed, dtype, torch_device) for name, shape, kind in items}
    fn = "model.safetensors" if n == 1 else f"model-{s + 1:05d}-of-{n:05d}.safetensors"
    save_file(tensors, os.path.join(out, fn), metadata={"format": "pt"})
    sizes = [(name, t.numel() * t.element_size()) for name, t in tensors.items()]
    if n > 4:
        print(f"  wrote {fn} ({len(tensors)} tensors)", flush=True)
    return fn, sizes


def write_checkpoint(out: str, preset, seed: int, dtype: str = "bf16", jobs: int = 1,
                     torch_device: str = "") -> dict:
    """preset: a name in PRESETS, or such a dict (main's --experts)."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    os.makedirs(out, exist_ok=True)
    cfg = make_config(p, dtype)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    for fn in os.listdir(out):  # stale weight files of an earlier run
        if fn.startswith("model") and (fn.endswith(".safetensors") or fn.endswith(".index.json")):
            os.remove(os.path.join(out, fn))
    n = p["shards"]
    by_shard: Dict[int, List[Tuple[str, Tuple[int, ...], str]]] = {}
    for item in inventory(p):
        by_shard.setdefault(shard_of(item[0], p), []).append(item)
    weight_map, total = {}, 0
    work = [(out, s, n, by_shard.get(s, []), seed, dtype, torch_device) for s in range(n)]
    if jobs > 1 and n > 1:  # shards in parallel processes (each tensor is seeded by its name: same bytes)
        import multiprocessing as mp
        # a CUDA generator cannot live in a forked child of a process that has touched CUDA: spawn then
        with mp.get_context("spawn" if torch_device.startswith("cuda") else "fork").Pool(min(jobs, n)) as pool:
            done = pool.imap(_write_shard, work)
            for fn, sizes in done:
                for name, nbytes in sizes:
                    weight_map[name] = fn
                    total += nbytes
    else:
        for w in work:
            fn, sizes = _write_shard(w)
            for name, nbytes in sizes:
                weight_map[name] = fn
                total += nbytes
    if n > 1:
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                      f, indent=2)
            f.write("\n")
    return cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--out")
    ap.add_argument("--dry-run", action="store_true", help="print parameter counts and sizes only")
    ap.add_argument("--jobs", type=int, default=1,
                    help="write this many shards at once, in processes of their own (the same bytes; each holds "
                         "one shard in memory: ~3.6 GB for a kl-full MoE layer)")
    ap.add_argument("--torch-device", default="", metavar="DEV",
                    help="draw with torch's generator on DEV (cpu, cuda) instead of numpy: kl-full in about a "
                         "minute on a GPU machine instead of many; other bytes than the default, which the "
                         "committed fixtures use")
    ap.add_argument("--experts", type=int, default=0, metavar="N",
                    help="routed experts per layer instead of the preset's (top-k kept): the released shapes with "
                         "fewer experts fit a smaller GPU and read the same bytes per decoded token")
    a = ap.parse_args(argv)
    p = dict(PRESETS[a.preset])
    if a.experts:
        if a.experts < p["topk"]:
            ap.error(f"--experts {a.experts}: fewer than the preset's top-k ({p['topk']})")
        p["experts"] = a.experts
    if a.torch_device:
        try:
            torch.empty(1, device=a.torch_device)
        except (RuntimeError, AssertionError) as e:
            ap.error(f"--torch-device {a.torch_device}: {str(e).splitlines()[0]}")
    if a.dry_run or not a.out:
        dry_run(p, a.dtype)
        if not a.dry_run:
            print("(no --out given: nothing written)")
        return 0
    dry_run(p, a.dtype)
    if a.jobs < 1:
        ap.error("--jobs must be >= 1")
    write_checkpoint(a.out, p, a.seed, a.dtype, a.jobs, a.torch_device)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
