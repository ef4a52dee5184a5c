#!/usr/bin/env python3
"""Plain float64 PyTorch reference of the Kimi K3 text model.

Written straight from spec/k3-architecture.md (sections 1-3); no kernels, no caches: every call
runs one full causal pass over the given token ids. It is slow and meant for tiny checkpoints
(tests/fixtures/tiny-*) and third-party fixture checks.

Reads a checkpoint directory in the released layout:
  * config.json: nested (wrapper `kimi_k3` + `text_config` + `text_config.linear_attn_config`,
    one-based layer lists) or the flat `kimi_linear` form (the text_config keys at top level);
  * model.safetensors.index.json + shards, or a single model.safetensors;
  * tensor names `language_model.model.*` + `language_model.lm_head.weight` (a plain
    `model.*` + `lm_head.weight` naming is accepted as well);
  * BF16 / F16 / F32 tensors; routed experts either MXFP4 (`experts.E.wN.weight_packed` +
    `weight_scale`) or plain `experts.E.wN.weight`, decided by the presence of `.weight_packed`.

Usage as a library:
    m = K3Reference("tests/fixtures/tiny")
    logits = m.forward([1, 2, 3])            # torch.float64 [T, vocab]
    diag = m.diagnostics([1, 2, 3])          # per-layer SiTU / router diagnostics
    toks = m.greedy([1, 2, 3], n=8)

Command line:
    python tools/reference/k3_reference.py CKPT_DIR --ids 1 2 3 [--greedy 8] [--mla-lora-norm-eps 1e-6]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
from safetensors import safe_open

F64 = torch.float64

# E2M1 code -> value (bit 3 = sign), spec §2.9.
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


# --------------------------------------------------------------------------------------------
# config


@dataclass
class K3TextConfig:
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    situ_beta: float
    situ_linear_beta: float
    intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int
    latent_moe_use_norm: bool
    moe_renormalize: bool
    routed_scaling_factor: float
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    attn_res_block_size: int
    full_attn_layers: List[int]  # one-based, as in the file
    kda_layers: List[int]  # one-based, as in the file
    kda_num_heads: int
    kda_head_dim: int
    short_conv_kernel_size: int
    gate_lower_bound: float
    use_full_rank_gate: bool
    nested: bool = True
    raw: dict = field(default_factory=dict, repr=False)

    def is_kda(self, layer: int) -> bool:
        """Zero-based layer predicate: KDA iff (layer+1) is in the one-based kda_layers."""
        return (layer + 1) in self.kda_layers

    def is_dense(self, layer: int) -> bool:
        return layer < self.first_k_dense_replace


def parse_config(cfg: dict) -> K3TextConfig:
    nested = "text_config" in cfg
    t = cfg["text_config"] if nested else cfg
    la = t["linear_attn_config"]
    if t.get("hidden_act", "situ") != "situ":
        raise ValueError(f"unsupported hidden_act {t.get('hidden_act')}")
    if t.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ValueError("only the sigmoid router is implemented")
    if int(t.get("num_expert_group", 1)) != 1 or int(t.get("topk_group", 1)) != 1:
        raise ValueError("grouped top-k with more than one group is not implemented")
    if int(t.get("moe_layer_freq", 1)) != 1:
        raise ValueError("moe_layer_freq != 1 is not implemented")
    if not la.get("use_full_rank_gate", True):
        raise ValueError("low-rank KDA output gate is not implemented")
    if t.get("tie_word_embeddings", False) or cfg.get("tie_word_embeddings", False):
        raise ValueError("tied embeddings are not K3")
    return K3TextConfig(
        hidden_size=int(t["hidden_size"]),
        num_hidden_layers=int(t["num_hidden_layers"]),
        vocab_size=int(t["vocab_size"]),
        rms_norm_eps=float(t["rms_norm_eps"]),
        situ_beta=float(t["activation_situ_beta"]),
        situ_linear_beta=float(t["activation_situ_linear_beta"]),
        intermediate_size=int(t["intermediate_size"]),
        first_k_dense_replace=int(t["first_k_dense_replace"]),
        moe_layer_freq=int(t.get("moe_layer_freq", 1)),
        num_experts=int(t["num_experts"]),
        num_experts_per_token=int(t["num_experts_per_token"]),
        num_shared_experts=int(t["num_shared_experts"]),
        moe_intermediate_size=int(t["moe_intermediate_size"]),
        routed_expert_hidden_size=int(t["routed_expert_hidden_size"]),
        latent_moe_use_norm=bool(t.get("latent_moe_use_norm", True)),
        moe_renormalize=bool(t.get("moe_renormalize", True)),
        routed_scaling_factor=float(t.get("routed_scaling_factor", 1.0)),
        num_attention_heads=int(t["num_attention_heads"]),
        q_lora_rank=int(t["q_lora_rank"]),
        kv_lora_rank=int(t["kv_lora_rank"]),
        qk_nope_head_dim=int(t["qk_nope_head_dim"]),
        qk_rope_head_dim=int(t["qk_rope_head_dim"]),
        v_head_dim=int(t["v_head_dim"]),
        mla_use_output_gate=bool(t.get("mla_use_output_gate", True)),
        attn_res_block_size=int(t["attn_res_block_size"]),
        full_attn_layers=[int(x) for x in la["full_attn_layers"]],
        kda_layers=[int(x) for x in la["kda_layers"]],
        kda_num_heads=int(la["num_heads"]),
        kda_head_dim=int(la["head_dim"]),
        short_conv_kernel_size=int(la["short_conv_kernel_size"]),
        gate_lower_bound=float(la["gate_lower_bound"]),
        use_full_rank_gate=bool(la.get("use_full_rank_gate", True)),
        nested=nested,
        raw=cfg,
    )


# --------------------------------------------------------------------------------------------
# checkpoint reading


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 -> float64. packed U8 [rows, cols/2] (low nibble = even column), scale U8 E8M0
    [rows, cols/32]; W[o,i] = E2M1[code] * 2^(scale[o, i//32] - 127). Scale 255 (NaN in OCP MX)
    decodes to NaN."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError("MXFP4 tensors must be U8")
    rows, half = packed.shape
    cols = half * 2
    if scale.shape != (rows, cols // 32) or cols % 32 != 0:
        raise ValueError(f"MXFP4 scale shape {tuple(scale.shape)} does not fit packed {tuple(packed.shape)}")
    p = packed.to(torch.int64)
    codes = torch.empty(rows, cols, dtype=torch.int64)
    codes[:, 0::2] = p & 0x0F
    codes[:, 1::2] = p >> 4
    table = torch.tensor(E2M1_TABLE, dtype=F64)
    vals = table[codes]
    s = scale.to(torch.int64)
    factor = torch.pow(torch.tensor(2.0, dtype=F64), (s - 127).to(F64))
    factor = torch.where(s == 255, torch.tensor(float("nan"), dtype=F64), factor)
    factor = factor.repeat_interleave(32, dim=1)
    return vals * factor


class Checkpoint:
    """Name -> tensor access over a single file or an index + shards."""

    def __init__(self, ckpt_dir: str):
        self.dir = ckpt_dir
        idx = os.path.join(ckpt_dir, "model.safetensors.index.json")
        single = os.path.join(ckpt_dir, "model.safetensors")
        self.name_to_file: Dict[str, str] = {}
        if os.path.exists(idx):
            with open(idx) as f:
                wm = json.load(f)["weight_map"]
            for name, fn in wm.items():
                self.name_to_file[name] = os.path.join(ckpt_dir, fn)
        elif os.path.exists(single):
            with safe_open(single, "pt") as f:
                for name in f.keys():
                    self.name_to_file[name] = single
        else:
            raise FileNotFoundError(f"{ckpt_dir}: no model.safetensors(.index.json)")
        self._handles = {}
        if "language_model.lm_head.weight" in self.name_to_file:
            self.prefix, self.head_name = "language_model.model.", "language_model.lm_head.weight"
        elif "lm_head.weight" in self.name_to_file:
            self.prefix, self.head_name = "model.", "lm_head.weight"
        else:
            raise KeyError(f"{ckpt_dir}: no lm_head tensor")

    def has(self, name: str) -> bool:
        return name in self.name_to_file

    def raw(self, name: str) -> torch.Tensor:
        fn = self.name_to_file[name]
        h = self._handles.get(fn)
        if h is None:
            h = safe_open(fn, "pt")
            self._handles[fn] = h
        return h.get_tensor(name)

    def f64(self, name: str) -> torch.Tensor:
        t = self.raw(name)
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            raise ValueError(f"{name}: unexpected dtype {t.dtype}")
        return t.to(F64)

    def expert_weight(self, base: str) -> torch.Tensor:
        """base = '...experts.E.w1'; MXFP4 iff '<base>.weight_packed' exists."""
        if self.has(base + ".weight_packed"):
            return dequant_mxfp4(self.raw(base + ".weight_packed"), self.raw(base + ".weight_scale"))
        return self.f64(base + ".weight")


def load_config_file(ckpt_dir: str) -> dict:
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        return json.load(f)


# --------------------------------------------------------------------------------------------
# math helpers


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm_w,eps(x) = w * x / sqrt(mean(x^2) + eps) over the last dim."""
    return w * x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)


def situ(g: torch.Tensor, u: torch.Tensor, b1: float, b2: float) -> torch.Tensor:
    """SiTU(g,u) = [b1*tanh(g/b1) * sigmoid(g)] * [b2*tanh(u/b2)] (sigmoid of the UNCAPPED g)."""
    return (b1 * torch.tanh(g / b1) * torch.sigmoid(g)) * (b2 * torch.tanh(u / b2))


def attn_res_agg(sources: Sequence[torch.Tensor], w_norm: torch.Tensor, w_proj: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Block AttnRes aggregator (spec §3.3). sources: list of [T, H]; keys normalised, values raw."""
    v = torch.stack(list(sources), dim=0)  # [n, T, H]
    keys = rms_norm(v, w_norm, eps)
    s = (keys * w_proj).sum(dim=-1)  # [n, T]
    p = torch.softmax(s, dim=0)
    return (p.unsqueeze(-1) * v).sum(dim=0)


def causal_short_conv_silu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU. x [T, C], w [C, 1, K] (w[c, K-1] multiplies the current input)."""
    T, C = x.shape
    K = w.shape[-1]
    w2 = w.reshape(C, K)
    xp = torch.cat([torch.zeros(K - 1, C, dtype=x.dtype), x], dim=0)  # zeros before the start
    out = torch.zeros(T, C, dtype=x.dtype)
    for j in range(K):
        out = out + w2[:, j] * xp[j:j + T]
    return torch.nn.functional.silu(out)


# --------------------------------------------------------------------------------------------
# model


class K3Reference:
    def __init__(self, ckpt_dir: str, mla_lora_norm_eps: float = 1e-6):
        self.dir = ckpt_dir
        self.cfg = parse_config(load_config_file(ckpt_dir))
        self.ck = Checkpoint(ckpt_dir)
        self.mla_lora_norm_eps = mla_lora_norm_eps
        self._cache: Dict[str, torch.Tensor] = {}

    # weights ---------------------------------------------------------------------------------
    def w(self, suffix: str) -> torch.Tensor:
        name = self.ck.prefix + suffix
        t = self._cache.get(name)
        if t is None:
            t = self.ck.f64(name)
            self._cache[name] = t
        return t

    def expert(self, layer: int, e: int, which: str) -> torch.Tensor:
        base = f"{self.ck.prefix}layers.{layer}.block_sparse_moe.experts.{e}.{which}"
        t = self._cache.get(base)
        if t is None:
            t = self.ck.expert_weight(base)
            self._cache[base] = t
        return t

    def head(self) -> torch.Tensor:
        t = self._cache.get("__head__")
        if t is None:
            t = self.ck.f64(self.ck.head_name)
            self._cache["__head__"] = t
        return t

    # KDA (§3.5) ------------------------------------------------------------------------------
    def kda(self, L: int, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        p = f"layers.{L}.self_attn."
        T = x.shape[0]
        nh, d = c.kda_num_heads, c.kda_head_dim
        q = causal_short_conv_silu(x @ self.w(p + "q_proj.weight").T, self.w(p + "q_conv1d.weight"))
        k = causal_short_conv_silu(x @ self.w(p + "k_proj.weight").T, self.w(p + "k_conv1d.weight"))
        v = causal_short_conv_silu(x @ self.w(p + "v_proj.weight").T, self.w(p + "v_conv1d.weight"))
        f = (x @ self.w(p + "f_a_proj.weight").T) @ self.w(p + "f_b_proj.weight").T
        b = x @ self.w(p + "b_proj.weight").T  # [T, nh]
        r = x @ self.w(p + "g_proj.weight").T  # [T, nh*d]
        q = q.view(T, nh, d)
        k = k.view(T, nh, d)
        v = v.view(T, nh, d)
        # L2 norm (sum of squares, eps 1e-6 inside) on q and k, then q * d^-1/2
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        q = q * (d ** -0.5)
        # lower-bound decay gate, A_log indexed per HEAD (first nh elements of the padded vector)
        A_log = self.w(p + "A_log").reshape(-1)[:nh]  # [nh]
        dt_bias = self.w(p + "dt_bias").view(nh, d)
        g = c.gate_lower_bound * torch.sigmoid(torch.exp(A_log).view(1, nh, 1) * (f.view(T, nh, d) + dt_bias))
        alpha = torch.exp(g)  # [T, nh, d]
        beta = torch.sigmoid(b)  # [T, nh]
        S = torch.zeros(nh, d, d, dtype=F64)  # S[h][key][value]
        outs = []
        for t in range(T):
            S = alpha[t].unsqueeze(-1) * S  # decay each key row
            u = torch.einsum("hkv,hk->hv", S, k[t])  # read (prediction of v_t)
            S = S + beta[t].view(nh, 1, 1) * k[t].unsqueeze(-1) * (v[t] - u).unsqueeze(1)  # delta write
            outs.append(torch.einsum("hkv,hk->hv", S, q[t]))  # read from the UPDATED state
        o = torch.stack(outs, 0)  # [T, nh, d]
        o = rms_norm(o, self.w(p + "o_norm.weight"), c.rms_norm_eps)
        o = o * torch.sigmoid(r.view(T, nh, d))
        return o.reshape(T, nh * d) @ self.w(p + "o_proj.weight").T

    # gated MLA, NoPE (§3.6) --------------------------------------------------------------------
    def mla(self, L: int, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        p = f"layers.{L}.self_attn."
        T = x.shape[0]
        nh, dn, dr, dv, kvr = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        eps = self.mla_lora_norm_eps
        q = rms_norm(x @ self.w(p + "q_a_proj.weight").T, self.w(p + "q_a_layernorm.weight"), eps)
        q = (q @ self.w(p + "q_b_proj.weight").T).view(T, nh, dn + dr)
        q_nope, q_r = q[..., :dn], q[..., dn:]
        ckv = x @ self.w(p + "kv_a_proj_with_mqa.weight").T  # [T, kvr + dr]
        lat = rms_norm(ckv[:, :kvr], self.w(p + "kv_a_layernorm.weight"), eps)
        k_r = ckv[:, kvr:]  # unnormalised, unrotated, shared by all heads
        kv = (lat @ self.w(p + "kv_b_proj.weight").T).view(T, nh, dn + dv)
        k_nope, v = kv[..., :dn], kv[..., dn:]
        scores = (torch.einsum("thd,shd->hts", q_nope, k_nope) + torch.einsum("thd,sd->hts", q_r, k_r))
        scores = scores * ((dn + dr) ** -0.5)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        prob = torch.softmax(scores, dim=-1)
        a = torch.einsum("hts,shd->thd", prob, v).reshape(T, nh * dv)
        if c.mla_use_output_gate:
            a = a * torch.sigmoid(x @ self.w(p + "g_proj.weight").T)
        return a @ self.w(p + "o_proj.weight").T

    # FFNs (§3.7, §3.8) -----------------------------------------------------------------------
    def dense_ffn(self, L: int, x: torch.Tensor, diag: Optional[dict]) -> torch.Tensor:
        c = self.cfg
        p = f"layers.{L}.mlp."
        g = x @ self.w(p + "gate_proj.weight").T
        u = x @ self.w(p + "up_proj.weight").T
        if diag is not None:
            _situ_diag(diag, "dense", g, u, c)
        return situ(g, u, c.situ_beta, c.situ_linear_beta) @ self.w(p + "down_proj.weight").T

    def route(self, scores: torch.Tensor, bias: torch.Tensor):
        """noaux_tc routing: select top-k of (scores + bias), weight by the UNBIASED scores,
        renormalised with +1e-20, times routed_scaling_factor. Returns (sel [T,k], weights [T,k])."""
        c = self.cfg
        sel = torch.topk(scores + bias, c.num_experts_per_token, dim=-1).indices
        ws = torch.gather(scores, 1, sel)
        if c.moe_renormalize:
            ws = ws / (ws.sum(-1, keepdim=True) + 1e-20)
        return sel, ws * c.routed_scaling_factor

    def moe(self, L: int, x: torch.Tensor, diag: Optional[dict]) -> torch.Tensor:
        c = self.cfg
        p = f"layers.{L}.block_sparse_moe."
        T = x.shape[0]
        k = c.num_experts_per_token
        scores = torch.sigmoid(x @ self.w(p + "gate.weight").T)  # [T, E] fp64
        bias = self.w(p + "gate.e_score_correction_bias")
        sel, ws = self.route(scores, bias)
        z = x @ self.w(p + "routed_expert_down_proj.weight").T  # [T, latent]
        agg = torch.zeros(T, c.routed_expert_hidden_size, dtype=F64)
        gmax = umax = 0.0
        n_sat = 0
        for t in range(T):
            for j in range(k):
                e = int(sel[t, j])
                g = self.expert(L, e, "w1") @ z[t]
                u = self.expert(L, e, "w3") @ z[t]
                if diag is not None:
                    gmax = max(gmax, float(g.abs().max()))
                    umax = max(umax, float(u.abs().max()))
                    n_sat += int(((g.abs() > 3 * c.situ_beta) & (u.abs() > 3 * c.situ_linear_beta)).sum())
                agg[t] += ws[t, j] * (self.expert(L, e, "w2") @ situ(g, u, c.situ_beta, c.situ_linear_beta))
        if c.latent_moe_use_norm:
            agg = rms_norm(agg, self.w(p + "routed_expert_norm.weight"), c.rms_norm_eps)
        out = agg @ self.w(p + "routed_expert_up_proj.weight").T
        if c.num_shared_experts > 0:
            sg = x @ self.w(p + "shared_experts.gate_proj.weight").T
            su = x @ self.w(p + "shared_experts.up_proj.weight").T
            if diag is not None:
                _situ_diag(diag, "shared", sg, su, c)
            out = out + situ(sg, su, c.situ_beta, c.situ_linear_beta) @ self.w(p + "shared_experts.down_proj.weight").T
        if diag is not None:
            biased_sorted = torch.sort(scores + bias, dim=-1, descending=True).values
            # distance of the k-th selected score from the first rejected one (near-ties flip easily)
            diag["router_min_selection_gap"] = (float((biased_sorted[:, k - 1] - biased_sorted[:, k]).min())
                                                if k < c.num_experts else float("inf"))
            unbiased = torch.topk(scores, k, dim=-1).indices
            changed = [set(sel[t].tolist()) != set(unbiased[t].tolist()) for t in range(T)]
            diag["routed_gate_absmax"] = gmax
            diag["routed_up_absmax"] = umax
            diag["routed_both_saturated"] = n_sat  # elements with |g| > 3*beta1 AND |u| > 3*beta2
            diag["bias_changed_selection_tokens"] = int(sum(changed))
            diag["selected_experts"] = sorted(set(sel.reshape(-1).tolist()))
        return out

    # whole model (§3.2, §3.3, §3.9) --------------------------------------------------------------
    def forward(self, ids: Sequence[int], diagnostics: Optional[list] = None,
                hidden_trace: Optional[list] = None) -> torch.Tensor:
        """One full causal pass; returns float64 logits [T, vocab]. When `diagnostics` is a list,
        one dict per layer is appended to it. When `hidden_trace` is a list, the layer outputs P
        (partial block sums) are appended."""
        c = self.cfg
        ids_t = torch.tensor(list(ids), dtype=torch.int64)
        eps = c.rms_norm_eps
        P: Optional[torch.Tensor] = self.w("embed_tokens.weight")[ids_t]  # no scaling
        B: List[torch.Tensor] = []
        for L in range(c.num_hidden_layers):
            p = f"layers.{L}."
            d = {"layer": L, "type": "kda" if c.is_kda(L) else "mla",
                 "ffn": "dense" if c.is_dense(L) else "moe"} if diagnostics is not None else None
            # 1. attention-site aggregation (pass-through while B is empty)
            a = attn_res_agg(B + [P], self.w(p + "self_attention_res_norm.weight"),
                             self.w(p + "self_attention_res_proj.weight").reshape(-1), eps) if B else P
            # 2. snapshot
            if L % c.attn_res_block_size == 0:
                B.append(P)
                P = None
            # 3. attention
            h = rms_norm(a, self.w(p + "input_layernorm.weight"), eps)
            y = self.kda(L, h) if c.is_kda(L) else self.mla(L, h)
            # 4.
            P = y if P is None else P + y
            # 5. FFN-site aggregation (always)
            m = attn_res_agg(B + [P], self.w(p + "mlp_res_norm.weight"),
                             self.w(p + "mlp_res_proj.weight").reshape(-1), eps)
            # 6. FFN
            h2 = rms_norm(m, self.w(p + "post_attention_layernorm.weight"), eps)
            z = self.dense_ffn(L, h2, d) if c.is_dense(L) else self.moe(L, h2, d)
            # 7.
            P = P + z
            if d is not None:
                d["num_snapshots"] = len(B)
                d["max_abs_P"] = float(P.abs().max())
                diagnostics.append(d)
            if hidden_trace is not None:
                hidden_trace.append(P.clone())
        hf = attn_res_agg(B + [P], self.w("output_attn_res_norm.weight"),
                          self.w("output_attn_res_proj.weight").reshape(-1), eps)
        return rms_norm(hf, self.w("norm.weight"), eps) @ self.head().T

    def diagnostics(self, ids: Sequence[int]) -> List[dict]:
        """Per-layer diagnostics of one pass: routed/shared/dense SiTU input maxima, number of
        routed elements saturating both caps, tokens whose top-k changed because of the bias."""
        d: List[dict] = []
        self.forward(ids, diagnostics=d)
        return d

    def greedy(self, prompt: Sequence[int], n: int) -> List[int]:
        """n greedy tokens, each by a full recompute over prompt + generated so far."""
        seq = list(prompt)
        out = []
        for _ in range(n):
            t = int(torch.argmax(self.forward(seq)[-1]))
            out.append(t)
            seq.append(t)
        return out


def _situ_diag(diag: dict, site: str, g: torch.Tensor, u: torch.Tensor, c: K3TextConfig) -> None:
    diag[f"{site}_gate_absmax"] = float(g.abs().max())
    diag[f"{site}_up_absmax"] = float(u.abs().max())
    diag[f"{site}_both_saturated"] = int(((g.abs() > 3 * c.situ_beta) & (u.abs() > 3 * c.situ_linear_beta)).sum())


def summarize_diagnostics(diags: List[dict], cfg: K3TextConfig) -> dict:
    """Whole-model summary used by the fixture generator."""
    moe = [d for d in diags if d["ffn"] == "moe"]
    return {
        "situ_gate_threshold": 3 * cfg.situ_beta,
        "situ_up_threshold": 3 * cfg.situ_linear_beta,
        "routed_gate_absmax": max((d["routed_gate_absmax"] for d in moe), default=0.0),
        "routed_up_absmax": max((d["routed_up_absmax"] for d in moe), default=0.0),
        "routed_both_saturated_elements": sum(d["routed_both_saturated"] for d in moe),
        "layers_with_routed_saturation": [d["layer"] for d in moe if d["routed_both_saturated"] > 0],
        "bias_changed_selection_tokens": sum(d["bias_changed_selection_tokens"] for d in moe),
        "layers_with_bias_changed_selection": [d["layer"] for d in moe if d["bias_changed_selection_tokens"] > 0],
        "router_min_selection_gap": min((d["router_min_selection_gap"] for d in moe), default=float("inf")),
        "max_abs_partial_sum": max(d["max_abs_P"] for d in diags),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("--ids", type=int, nargs="+", required=True)
    ap.add_argument("--greedy", type=int, default=0, help="generate N greedy tokens after --ids")
    ap.add_argument("--mla-lora-norm-eps", type=float, default=1e-6)
    ap.add_argument("--diagnostics", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    m = K3Reference(a.ckpt, mla_lora_norm_eps=a.mla_lora_norm_eps)
    diags: List[dict] = []
    logits = m.forward(a.ids, diagnostics=diags if a.diagnostics else None)
    print("argmax:", logits.argmax(-1).tolist())
    print("last logits head:", [round(float(x), 6) for x in logits[-1, :8]])
    if a.diagnostics:
        for d in diags:
            print(json.dumps(d))
        print(json.dumps(summarize_diagnostics(diags, m.cfg)))
    if a.greedy:
        print("greedy:", m.greedy(a.ids, a.greedy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
