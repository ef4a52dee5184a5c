#!/usr/bin/env python3
"""Kimi Linear (model_type kimi_linear) references for the released Moonshot checkpoint layout.

(a) `KimiLinearRef`: our own plain float64 forward (torch float64 on CPU, straightforward loops:
    token-by-token recurrent KDA with its short-conv state, full causal MLA over a latent cache,
    sigmoid router with e_score_correction_bias). It follows docs/kimi-linear.md exactly and keeps
    per-layer state, so a full pass and incremental decoding run the same code.
(b) `load_transformers` / `transformers_logits` / `transformers_greedy`: transformers' own
    `KimiLinearForCausalLM` (5.25.0) in fp32 on CPU, loaded from the same directory. transformers
    converts the released names itself (conversion_mapping.py, mapping["kimi_linear"]); we pass
    `use_kernels=False` and fla/causal_conv1d are not installed, so its pure-torch fallbacks run:
    `chunk_kimi_delta_attention` (chunk 64) for multi-token passes, `recurrent_kimi_delta_attention`
    for cached single-token steps, `causal_conv1d_fn` / `causal_conv1d_update`, eager attention.

Usage (prints rel-L2 of the two over a seeded sequence):
  python tools/reference/kimi_linear_reference.py CHECKPOINT_DIR [--ids 1,2,3] [--no-transformers]
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from typing import Dict, List, Optional

import numpy as np
import torch
from safetensors.torch import load_file

F64 = torch.float64
KV_NORM_EPS = 1e-6    # kv_a_layernorm: transformers/Moonshot build it with the RMSNorm default (docs §3.2)
L2NORM_EPS = 1e-6     # q/k l2norm, eps inside the sqrt
SOFTPLUS_THRESHOLD = 20.0


def load_checkpoint(path: str):
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    idx = os.path.join(path, "model.safetensors.index.json")
    files = sorted(set(json.load(open(idx))["weight_map"].values())) if os.path.exists(idx) \
        else ["model.safetensors"]
    w: Dict[str, torch.Tensor] = {}
    for fn in files:
        for k, t in load_file(os.path.join(path, fn)).items():
            w[k] = t.to(F64)
    return cfg, w


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def silu(x):
    return x * torch.sigmoid(x)


def softplus(x):
    return torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(torch.clamp(x, max=SOFTPLUS_THRESHOLD))))


def l2norm(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def rope_rotate(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE over the last dim (only for the `mla_rope_on_pe_dims` trap variant)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=F64) / d)
    ang = pos.to(F64)[:, None] * inv[None, :]                      # [P, d/2]
    shape = [ang.shape[0]] + [1] * (x.dim() - 2) + [d // 2]
    cos, sin = torch.cos(ang).view(shape), torch.sin(ang).view(shape)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class KimiLinearRef:
    """Float64 reference. `forward(ids, state)` appends ids to `state` (a dict from `new_state()`) and
    returns their logits [len(ids), vocab]; a fresh state gives the full causal pass."""

    # deliberate mistakes, for tests/python/test_kl_fixture.py (must all be off for the reference)
    VARIANTS = ("conv_taps_reversed", "decay_on_value_dim", "out_gate_silu", "o_norm_over_all_heads",
                "no_qk_l2norm", "router_weights_from_biased_scores", "no_router_bias", "no_renormalize",
                "mla_rope_on_pe_dims")

    def __init__(self, cfg: dict, w: Dict[str, torch.Tensor], variant: Optional[set] = None):
        self.cfg, self.w = cfg, w
        self.variant = set(variant or ())
        unknown = self.variant - set(self.VARIANTS)
        if unknown:
            raise ValueError(f"unknown variants {sorted(unknown)}")
        la = cfg["linear_attn_config"]
        self.L = cfg["num_hidden_layers"]
        kda = set(la["kda_layers"])
        full = set(la.get("full_attn_layers") or [])
        self.kind = []
        for i in range(self.L):  # 1-indexed lists
            one = i + 1
            if one in kda and one in full:
                raise ValueError(f"layer {one} listed as both KDA and MLA")
            if one not in kda and one not in full:
                raise ValueError(f"layer {one} in neither kda_layers nor full_attn_layers")
            self.kind.append("kda" if one in kda else "mla")
        self.eps = cfg["rms_norm_eps"]
        self.Hk, self.D, self.K = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
        self.Nh = cfg["num_attention_heads"]
        self.R, self.nope, self.rope, self.vd = (cfg["kv_lora_rank"], cfg["qk_nope_head_dim"],
                                                 cfg["qk_rope_head_dim"], cfg["v_head_dim"])
        self.first_dense = cfg.get("first_k_dense_replace", 1)
        self.moe_freq = cfg.get("moe_layer_freq", 1)
        self.topk = cfg["num_experts_per_token"]
        self.E = cfg["num_experts"]
        self.scaling = cfg["routed_scaling_factor"]
        self.renorm = cfg.get("moe_renormalize", True)
        if cfg.get("q_lora_rank") is not None:
            raise ValueError("q_lora_rank must be null for kimi_linear")
        if not cfg.get("mla_use_nope", False):
            raise ValueError("only mla_use_nope=true (NoPE MLA) is defined for kimi_linear")
        if cfg.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ValueError("router activation must be sigmoid")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError("hidden_act must be silu")
        if cfg.get("num_expert_group", 1) != 1 or cfg.get("topk_group", 1) != 1:
            raise ValueError("grouped top-k with more than one group is not implemented here")
        self.diag = self._fresh_diag()

    @staticmethod
    def _fresh_diag():
        return {"router_min_selection_gap": float("inf"), "bias_changed_selection_tokens": 0,
                "layers_with_bias_changed_selection": set(), "kda_min_decay": float("inf"),
                "kda_max_decay": 0.0}

    def is_moe(self, i: int) -> bool:
        return i >= self.first_dense and i % self.moe_freq == 0

    def new_state(self):
        st = []
        for i in range(self.L):
            if self.kind[i] == "kda":
                W = self.Hk * self.D
                st.append({"conv": [torch.zeros(self.K - 1, W, dtype=F64) for _ in range(3)],
                           "S": torch.zeros(self.Hk, self.D, self.D, dtype=F64)})
            else:
                st.append({"c": torch.zeros(0, self.R, dtype=F64), "kpe": torch.zeros(0, self.rope, dtype=F64)})
        return st

    # ---------------------------------------------------------------- layers
    def kda(self, i: int, x: torch.Tensor, st: dict) -> torch.Tensor:
        w, p = self.w, f"model.layers.{i}.self_attn."
        T = x.shape[0]
        Hk, D, K = self.Hk, self.D, self.K
        streams = []
        for j, n in enumerate(("q", "k", "v")):
            pre = x @ w[p + f"{n}_proj.weight"].T                        # [T, W]
            buf = torch.cat([st["conv"][j], pre], 0)                      # [K-1+T, W]
            cw = w[p + f"{n}_conv1d.weight"][:, 0, :]                     # [W, K]; tap K-1 = current token
            if "conv_taps_reversed" in self.variant:
                cw = cw.flip(-1)
            out = torch.stack([(buf[t:t + K] * cw.T).sum(0) for t in range(T)], 0)
            st["conv"][j] = buf[-(K - 1):].clone() if K > 1 else buf[:0]
            streams.append(silu(out).view(T, Hk, D))
        q, k, v = streams
        if "no_qk_l2norm" in self.variant:
            q = q * (D ** -0.5)
        else:
            q = l2norm(q) * (D ** -0.5)
            k = l2norm(k)
        f = (x @ w[p + "f_a_proj.weight"].T) @ w[p + "f_b_proj.weight"].T     # [T, W]
        g = -torch.exp(w[p + "A_log"].reshape(Hk))[None, :, None] * softplus(
            (f + w[p + "dt_bias"].reshape(-1)).view(T, Hk, D))
        decay = torch.exp(g)
        self.diag["kda_min_decay"] = min(self.diag["kda_min_decay"], float(decay.min()))
        self.diag["kda_max_decay"] = max(self.diag["kda_max_decay"], float(decay.max()))
        beta = torch.sigmoid(x @ w[p + "b_proj.weight"].T)                    # [T, Hk]
        S = st["S"]
        o = torch.zeros(T, Hk, D, dtype=F64)
        for t in range(T):
            for h in range(Hk):
                if "decay_on_value_dim" in self.variant:
                    Sh = S[h] * decay[t, h][None, :]
                else:
                    Sh = S[h] * decay[t, h][:, None]              # decay along the key dim d
                u = beta[t, h] * (v[t, h] - Sh.T @ k[t, h])       # [D_v]
                Sh = Sh + torch.outer(k[t, h], u)
                S[h] = Sh
                o[t, h] = Sh.T @ q[t, h]
        gate = ((x @ w[p + "g_a_proj.weight"].T) @ w[p + "g_b_proj.weight"].T).view(T, Hk, D)
        act = silu if "out_gate_silu" in self.variant else torch.sigmoid
        if "o_norm_over_all_heads" in self.variant:
            y = rmsnorm(o.reshape(T, Hk * D), w[p + "o_norm.weight"].repeat(Hk), self.eps).view(T, Hk, D) * act(gate)
        else:
            y = rmsnorm(o, w[p + "o_norm.weight"], self.eps) * act(gate)
        return y.reshape(T, Hk * D) @ w[p + "o_proj.weight"].T

    def mla(self, i: int, x: torch.Tensor, st: dict) -> torch.Tensor:
        w, p = self.w, f"model.layers.{i}.self_attn."
        T = x.shape[0]
        Nh, R, nope, rope, vd = self.Nh, self.R, self.nope, self.rope, self.vd
        q = (x @ w[p + "q_proj.weight"].T).view(T, Nh, nope + rope)
        ckv = x @ w[p + "kv_a_proj_with_mqa.weight"].T
        c = rmsnorm(ckv[:, :R], w[p + "kv_a_layernorm.weight"], KV_NORM_EPS)
        st["c"] = torch.cat([st["c"], c], 0)
        st["kpe"] = torch.cat([st["kpe"], ckv[:, R:]], 0)
        P = st["c"].shape[0]                                    # positions so far (incl. these T)
        kv = (st["c"] @ w[p + "kv_b_proj.weight"].T).view(P, Nh, nope + vd)
        kpe = st["kpe"]
        if "mla_rope_on_pe_dims" in self.variant:  # what a DeepSeek-style engine would do (wrong here)
            q = torch.cat([q[..., :nope], rope_rotate(q[..., nope:], torch.arange(P - T, P))], -1)
            kpe = rope_rotate(kpe, torch.arange(P))
        kfull = torch.cat([kv[..., :nope], kpe[:, None, :].expand(P, Nh, rope)], -1)
        vfull = kv[..., nope:]
        scale = (nope + rope) ** -0.5
        out = torch.zeros(T, Nh, vd, dtype=F64)
        for t in range(T):
            pos = P - T + t
            s = torch.einsum("hd,phd->hp", q[t], kfull[:pos + 1]) * scale
            a = torch.softmax(s, -1)
            out[t] = torch.einsum("hp,phd->hd", a, vfull[:pos + 1])
        return out.reshape(T, Nh * vd) @ w[p + "o_proj.weight"].T

    def glu(self, x, gate_w, up_w, down_w):
        return (silu(x @ gate_w.T) * (x @ up_w.T)) @ down_w.T

    def moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        w, p = self.w, f"model.layers.{i}.block_sparse_moe."
        s = torch.sigmoid(x @ w[p + "gate.weight"].T)                       # [T, E]
        choice = s + (0 if "no_router_bias" in self.variant else w[p + "gate.e_score_correction_bias"][None, :])
        y = torch.zeros_like(x)
        for t in range(x.shape[0]):
            order = torch.argsort(choice[t], descending=True)
            idx = order[: self.topk]
            if self.topk < self.E:
                gap = float(choice[t, order[self.topk - 1]] - choice[t, order[self.topk]])
                self.diag["router_min_selection_gap"] = min(self.diag["router_min_selection_gap"], gap)
                plain = set(torch.argsort(s[t], descending=True)[: self.topk].tolist())
                if plain != set(idx.tolist()):
                    self.diag["bias_changed_selection_tokens"] += 1
                    self.diag["layers_with_bias_changed_selection"].add(i)
            wt = (choice if "router_weights_from_biased_scores" in self.variant else s)[t, idx]
            if self.renorm and "no_renormalize" not in self.variant:
                wt = wt / (wt.sum() + 1e-20)
            wt = wt * self.scaling
            for j, e in enumerate(idx.tolist()):
                q = p + f"experts.{e}."
                y[t] += wt[j] * self.glu(x[t], w[q + "w1.weight"], w[q + "w3.weight"], w[q + "w2.weight"])
        sh = p + "shared_experts."
        return y + self.glu(x, w[sh + "gate_proj.weight"], w[sh + "up_proj.weight"], w[sh + "down_proj.weight"])

    # ---------------------------------------------------------------- model
    @torch.no_grad()
    def forward(self, ids: List[int], state=None) -> torch.Tensor:
        st = self.new_state() if state is None else state
        w = self.w
        h = w["model.embed_tokens.weight"][torch.tensor(ids, dtype=torch.long)]
        for i in range(self.L):
            pre = f"model.layers.{i}."
            x = rmsnorm(h, w[pre + "input_layernorm.weight"], self.eps)
            h = h + (self.kda(i, x, st[i]) if self.kind[i] == "kda" else self.mla(i, x, st[i]))
            x = rmsnorm(h, w[pre + "post_attention_layernorm.weight"], self.eps)
            if self.is_moe(i):
                h = h + self.moe(i, x)
            else:
                m = pre + "mlp."
                h = h + self.glu(x, w[m + "gate_proj.weight"], w[m + "up_proj.weight"], w[m + "down_proj.weight"])
        h = rmsnorm(h, w["model.norm.weight"], self.eps)
        return h @ w["lm_head.weight"].T

    def greedy(self, prompt: List[int], n: int):
        """Cached greedy decode; returns (ids, min top1-top2 margin over the n steps)."""
        st = self.new_state()
        logits = self.forward(prompt, st)[-1]
        out, mmin = [], float("inf")
        for _ in range(n):
            top = torch.topk(logits, 2).values
            mmin = min(mmin, float(top[0] - top[1]))
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            logits = self.forward([nxt], st)[-1]
        return out, mmin


# -------------------------------------------------------------------- transformers (fp32, CPU)

class _FallbackLog(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: List[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if "falling back" in msg or "fall back" in msg:
            self.messages.append(msg)


_FALLBACKS = _FallbackLog()


def load_transformers(path: str, dtype=torch.float32):
    import transformers
    from transformers import KimiLinearForCausalLM
    logging.getLogger("transformers").addHandler(_FALLBACKS)
    model, info = KimiLinearForCausalLM.from_pretrained(path, dtype=dtype, use_kernels=False,
                                                        output_loading_info=True)
    bad = {k: sorted(v) for k, v in info.items() if v}
    if bad:
        raise RuntimeError(f"transformers did not load the checkpoint cleanly: {bad}")
    model.eval()
    return model, transformers.__version__


def transformers_path_report() -> dict:
    import importlib.util
    return {
        "fla_installed": importlib.util.find_spec("fla") is not None,
        "kernels_installed": importlib.util.find_spec("kernels") is not None,
        "causal_conv1d_installed": importlib.util.find_spec("causal_conv1d") is not None,
        "use_kernels": False,
        "fallback_messages": sorted(set(m.split(" because")[0] for m in _FALLBACKS.messages)),
    }


@torch.no_grad()
def transformers_logits(model, ids: List[int]) -> torch.Tensor:
    """One full teacher-forced pass without a cache (chunked KDA fallback)."""
    out = model(torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0].to(F64)


@torch.no_grad()
def transformers_greedy(model, prompt: List[int], n: int):
    """Greedy with transformers' own cache: prefill (chunked KDA), then single-token recurrent steps."""
    g = model.generate(torch.tensor([prompt], dtype=torch.long), do_sample=False, max_new_tokens=n,
                       eos_token_id=None, pad_token_id=model.config.pad_token_id, use_cache=True,
                       return_dict_in_generate=True, output_logits=True)
    ids = g.sequences[0, len(prompt):].tolist()
    return ids, [s[0].to(F64) for s in g.logits]  # raw logits of each step


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--ids", help="comma-separated ids (default: 16 seeded ids)")
    ap.add_argument("--no-transformers", action="store_true")
    a = ap.parse_args(argv)
    cfg, w = load_checkpoint(a.checkpoint)
    ids = [int(x) for x in a.ids.split(",")] if a.ids else \
        np.random.default_rng(0).integers(0, cfg["vocab_size"], 16).tolist()
    ref = KimiLinearRef(cfg, w)
    lg = ref.forward(ids)
    print("own float64 argmax:", lg.argmax(-1).tolist())
    st = ref.new_state()
    inc = torch.cat([ref.forward([t], st) for t in ids], 0)
    print(f"incremental vs full (float64): max |diff| {float((inc - lg).abs().max()):.3e}")
    if not a.no_transformers:
        model, ver = load_transformers(a.checkpoint)
        tl = transformers_logits(model, ids)
        print(f"transformers {ver} fp32 argmax:", tl.argmax(-1).tolist())
        print(f"rel-L2(transformers fp32, own float64) = {rel_l2(tl, lg):.3e}")
        print("transformers path:", json.dumps(transformers_path_report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
