"""A trainable, batched PyTorch model of the Kimi K3 text architecture (spec §3), for training
K3-nano and for fast reference evaluation. Same math as tools/reference/k3_reference.py (the
fp64, token-by-token reference), but vectorised: KDA runs in the chunked (WY) form, MLA through
scaled_dot_product_attention, the MoE grouped by expert. Parameter names are the released
checkpoint's names without the `language_model.model.` prefix, so export is a rename.

Checked against k3_reference.py on the committed fixtures by tools/train/check_model.py.
Routed experts can run with MXFP4 fake quantisation (straight-through estimator), so that the
4-bit experts shipped after training are the ones the model was trained with.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass
class NanoConfig:
    vocab: int = 8448
    hidden: int = 320
    layers: int = 8
    mla_layers: List[int] = field(default_factory=lambda: [4, 8])  # one-based, as in config.json
    block: int = 3                  # attn_res_block_size
    kda_heads: int = 5
    kda_dim: int = 64
    conv: int = 4
    gate_lower_bound: float = -5.0
    mla_heads: int = 5
    q_lora: int = 160
    kv_lora: int = 128
    nope: int = 32
    rope: int = 16
    v: int = 64
    dense_inter: int = 896
    first_dense: int = 1
    experts: int = 32
    topk: int = 4
    shared: int = 1
    moe_inter: int = 320
    latent: int = 160
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    eps: float = 1e-5
    mla_lora_eps: float = 1e-6
    max_positions: int = 4096

    def is_kda(self, L: int) -> bool:
        return (L + 1) not in self.mla_layers


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps))


def situ(g: torch.Tensor, u: torch.Tensor, b1: float, b2: float) -> torch.Tensor:
    return (b1 * torch.tanh(g / b1) * torch.sigmoid(g)) * (b2 * torch.tanh(u / b2))


# ------------------------------------------------------------------------------------ MXFP4


def mxfp4_quantize(w: torch.Tensor):
    """w [rows, cols] (cols % 32 == 0) -> (codes int64 [rows, cols] in 0..15, scale_exp int64
    [rows, cols/32]) following OCP MX: shared exponent floor(log2(amax)) - 2 (E2M1's emax), each
    element rounded to the nearest E2M1 value (ties to the even code), saturating at 6."""
    rows, cols = w.shape
    wb = w.detach().float().reshape(rows, cols // 32, 32)
    amax = wb.abs().amax(-1)
    e = torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - 2
    e = e.clamp(-127, 127)
    x = wb / torch.pow(2.0, e).unsqueeze(-1)
    table = torch.tensor(E2M1_VALUES, device=w.device)
    mag = x.abs().clamp(max=6.0)
    # nearest of 8 magnitudes; ties go to the smaller index = even mantissa at these points
    d = (mag.unsqueeze(-1) - table).abs()
    idx = torch.argmin(d, dim=-1)
    codes = idx + 8 * (x < 0).long() * (idx > 0).long()
    return codes.reshape(rows, cols), (e + 127).long()


def mxfp4_dequant(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = codes.shape
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=codes.device)
    vals = table[codes].reshape(rows, cols // 32, 32)
    return (vals * torch.pow(2.0, (scale - 127).float()).unsqueeze(-1)).reshape(rows, cols)


def mxfp4_fake_quant(w: torch.Tensor) -> torch.Tensor:
    """Forward: the MXFP4 value of w; backward: identity (straight-through)."""
    codes, scale = mxfp4_quantize(w)
    q = mxfp4_dequant(codes, scale).to(w.dtype)
    return w + (q - w).detach()


def mxfp4_pack(w: torch.Tensor):
    """-> (weight_packed U8 [rows, cols/2] low nibble = even column, weight_scale U8 [rows, cols/32])."""
    codes, scale = mxfp4_quantize(w)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, scale.to(torch.uint8)


# ------------------------------------------------------------------------------------ KDA


def kda_chunked(q, k, v, g, beta, chunk: int = 32, S0: Optional[torch.Tensor] = None):
    if chunk > 32:
        raise ValueError("kda_chunked: chunk must be <= 32 (exp range of the factored decays)")
    # The recurrence must not run in bf16: autocast would lower these einsums and matmuls.
    with torch.autocast(device_type=q.device.type, enabled=False):
        return _kda_chunked(q, k, v, g, beta, chunk, S0)


def _kda_chunked(q, k, v, g, beta, chunk: int = 32, S0: Optional[torch.Tensor] = None):
    """Gated delta rule with per-channel decay, chunked (WY) form, float32.
    q, k: [B, T, H, D] (q already scaled), v: [B, T, H, Dv], g: [B, T, H, D] log-decay (<= 0),
    beta: [B, T, H]. Recurrence (per head, S[key][value]):
        S <- Diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t.
    Returns o [B, T, H, Dv] and the final state [B, H, D, Dv]."""
    B, T, H, D = k.shape
    Dv = v.shape[-1]
    C = chunk
    pad = (-T) % C
    if pad:  # zero keys / betas / decays at the end change nothing before them
        q, k, v, g = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n = (T + pad) // C
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32  # never below float32
    # [B, H, n, C, *]
    q, k, v, g = (t.reshape(B, n, C, H, -1).permute(0, 3, 1, 2, 4).to(dt) for t in (q, k, v, g))
    beta = beta.reshape(B, n, C, H).permute(0, 3, 1, 2).to(dt)
    G = torch.cumsum(g, dim=3)  # cumulative log decay inside each chunk
    # A[i,j] = sum_d k_i k_j exp(G_i - G_j) as one matmul, factored around the chunk's middle
    # position r: (k_i e^{G_i - G_r}) . (k_j e^{G_r - G_j}). With |g| <= |gate_lower_bound| = 5 and
    # C <= 32, every factor stays within e^{+-80} (fp32 holds e^88); entries above the diagonal
    # (which could overflow) are masked before use, so they never reach a result or a gradient.
    r = C // 2
    Gr = G[:, :, :, r:r + 1, :]
    left_k = k * torch.exp(G - Gr)
    left_q = q * torch.exp(G - Gr)
    right = k * torch.exp(Gr - G)
    strict = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1)
    tri_incl = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    A = (left_k @ right.transpose(-1, -2)).masked_fill(~strict, 0.0)
    Aqk = (left_q @ right.transpose(-1, -2)).masked_fill(~tri_incl, 0.0)  # includes the diagonal
    A = A * beta.unsqueeze(-1)
    L = A + torch.eye(C, device=k.device, dtype=dt)
    bk = beta.unsqueeze(-1) * (k * torch.exp(G))  # beta_j k_j ⊙ b_j
    bv = beta.unsqueeze(-1) * v
    W = torch.linalg.solve_triangular(L, bk, upper=False, unitriangular=True)
    U0 = torch.linalg.solve_triangular(L, bv, upper=False, unitriangular=True)
    qb = q * torch.exp(G)
    Glast = G[:, :, :, -1:, :]  # [B,H,n,1,D]
    kend = k * torch.exp(Glast - G)  # k_j ⊙ b_C / b_j
    S = torch.zeros(B, H, D, Dv, device=k.device, dtype=dt) if S0 is None else S0.to(dt)
    outs = []
    for c in range(n):
        U = U0[:, :, c] - W[:, :, c] @ S  # [B,H,C,Dv]
        outs.append(qb[:, :, c] @ S + Aqk[:, :, c] @ U)
        S = torch.exp(Glast[:, :, c, 0]).unsqueeze(-1) * S + kend[:, :, c].transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2)  # [B,H,n,C,Dv]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, n * C, H, Dv)[:, :T]
    return o, S


def kda_recurrent(q, k, v, g, beta, S0=None):
    """Token-by-token twin of kda_chunked (tests)."""
    B, T, H, D = k.shape
    S = torch.zeros(B, H, D, v.shape[-1], dtype=q.dtype, device=q.device) if S0 is None else S0
    outs = []
    for t in range(T):
        S = torch.exp(g[:, t]).unsqueeze(-1) * S
        u = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + beta[:, t].view(B, H, 1, 1) * k[:, t].unsqueeze(-1) * (v[:, t] - u).unsqueeze(2)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, 1), S


# ------------------------------------------------------------------------------------ modules


def _linear(out_f: int, in_f: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(out_f, in_f) / math.sqrt(in_f))


class AttnResSite(nn.Module):
    def __init__(self, H: int):
        super().__init__()
        self.norm = nn.Parameter(torch.ones(H))
        self.proj = nn.Parameter(torch.zeros(1, H))  # zero init: uniform mix over depth sources

    def forward(self, sources: List[torch.Tensor], eps: float) -> torch.Tensor:
        vals = torch.stack(sources, 0)  # [n, B, T, H]
        s = (rms_norm(vals, self.norm, eps) * self.proj.view(-1)).sum(-1)
        p = torch.softmax(s.to(torch.promote_types(s.dtype, torch.float32)), dim=0).to(vals.dtype)
        return (p.unsqueeze(-1) * vals).sum(0)


class KDA(nn.Module):
    def __init__(self, c: NanoConfig):
        super().__init__()
        H, nh, d, K = c.hidden, c.kda_heads, c.kda_dim, c.conv
        P = nh * d
        self.c = c
        self.q_proj, self.k_proj, self.v_proj = _linear(P, H), _linear(P, H), _linear(P, H)
        self.q_conv1d = nn.Parameter(torch.randn(P, 1, K) * 0.3)
        self.k_conv1d = nn.Parameter(torch.randn(P, 1, K) * 0.3)
        self.v_conv1d = nn.Parameter(torch.randn(P, 1, K) * 0.3)
        with torch.no_grad():  # start near identity: the current input dominates
            for w in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
                w[:, 0, K - 1] += 1.0
        self.f_a_proj = _linear(d, H)
        self.f_b_proj = _linear(P, d)
        self.A_log = nn.Parameter(torch.zeros(d))  # per HEAD: entries [0, nh) are used
        with torch.no_grad():
            self.A_log[:nh] = torch.log(torch.linspace(1.0, 16.0, nh)) - 2.0
        self.dt_bias = nn.Parameter(torch.zeros(P))
        self.b_proj = _linear(nh, H)
        self.g_proj = _linear(P, H)
        self.o_norm = nn.Parameter(torch.ones(d))
        self.o_proj = nn.Parameter(torch.randn(H, P) / math.sqrt(P) * 0.5)

    @staticmethod
    def conv_silu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Depthwise causal conv + SiLU as K shifted multiply-adds (w[:, 0, K-1] hits the current
        input); cheaper than a grouped conv1d for K = 4, forward and backward."""
        T, K = x.shape[1], w.shape[-1]
        xp = F.pad(x, (0, 0, K - 1, 0))
        w2 = w[:, 0, :].to(x.dtype)
        y = xp[:, 0:T] * w2[:, 0]
        for j in range(1, K):
            y = y + xp[:, j:j + T] * w2[:, j]
        return F.silu(y)

    def forward(self, x: torch.Tensor, chunk: int = 32, recurrent: bool = False) -> torch.Tensor:
        c = self.c
        B, T, _ = x.shape
        nh, d = c.kda_heads, c.kda_dim
        q = self.conv_silu(x @ self.q_proj.T, self.q_conv1d).view(B, T, nh, d)
        k = self.conv_silu(x @ self.k_proj.T, self.k_conv1d).view(B, T, nh, d)
        v = self.conv_silu(x @ self.v_proj.T, self.v_conv1d).view(B, T, nh, d)
        f = (x @ self.f_a_proj.T) @ self.f_b_proj.T
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        beta = torch.sigmoid((x @ self.b_proj.T).to(dt))
        r = x @ self.g_proj.T
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * (d ** -0.5)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        A = torch.exp(self.A_log[:nh].to(dt)).view(1, 1, nh, 1)
        g = c.gate_lower_bound * torch.sigmoid(A * (f.to(dt).view(B, T, nh, d) + self.dt_bias.to(dt).view(nh, d)))
        if recurrent:
            o, _ = kda_recurrent(q, k, v, g, beta)
        else:
            o, _ = kda_chunked(q, k, v, g, beta, chunk)
        o = rms_norm(o, self.o_norm.to(dt), c.eps).to(x.dtype)
        o = o * torch.sigmoid(r.view(B, T, nh, d))
        return o.reshape(B, T, nh * d) @ self.o_proj.T


class MLA(nn.Module):
    def __init__(self, c: NanoConfig):
        super().__init__()
        H, nh = c.hidden, c.mla_heads
        self.c = c
        self.q_a_proj = _linear(c.q_lora, H)
        self.q_a_layernorm = nn.Parameter(torch.ones(c.q_lora))
        self.q_b_proj = _linear(nh * (c.nope + c.rope), c.q_lora)
        self.kv_a_proj_with_mqa = _linear(c.kv_lora + c.rope, H)
        self.kv_a_layernorm = nn.Parameter(torch.ones(c.kv_lora))
        self.kv_b_proj = _linear(nh * (c.nope + c.v), c.kv_lora)
        self.g_proj = _linear(nh * c.v, H)
        self.o_proj = nn.Parameter(torch.randn(H, nh * c.v) / math.sqrt(nh * c.v) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        B, T, _ = x.shape
        nh, dn, dr, dv = c.mla_heads, c.nope, c.rope, c.v
        q = rms_norm(x @ self.q_a_proj.T, self.q_a_layernorm, c.mla_lora_eps)
        q = (q @ self.q_b_proj.T).view(B, T, nh, dn + dr)
        ckv = x @ self.kv_a_proj_with_mqa.T
        lat = rms_norm(ckv[..., :c.kv_lora], self.kv_a_layernorm, c.mla_lora_eps)
        k_r = ckv[..., c.kv_lora:]  # shared by all heads, never rotated (NoPE)
        kv = (lat @ self.kv_b_proj.T).view(B, T, nh, dn + dv)
        k = torch.cat([kv[..., :dn], k_r.unsqueeze(2).expand(B, T, nh, dr)], dim=-1)
        vv = kv[..., dn:]
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), vv.transpose(1, 2), is_causal=True,
                                           scale=(dn + dr) ** -0.5)
        a = a.transpose(1, 2).reshape(B, T, nh * dv)
        a = a * torch.sigmoid(x @ self.g_proj.T)
        return a @ self.o_proj.T


class GLU(nn.Module):
    def __init__(self, H: int, inter: int, c: NanoConfig):
        super().__init__()
        self.c = c
        self.gate_proj, self.up_proj = _linear(inter, H), _linear(inter, H)
        self.down_proj = nn.Parameter(torch.randn(H, inter) / math.sqrt(inter) * 0.5)

    def forward(self, x):
        return situ(x @ self.gate_proj.T, x @ self.up_proj.T, self.c.situ_beta, self.c.situ_linear_beta) @ self.down_proj.T


class Experts(nn.Module):
    """Routed experts as stacked tensors: w1/w3 [E, inter, latent], w2 [E, latent, inter]."""

    def __init__(self, c: NanoConfig):
        super().__init__()
        E, lat, mi = c.experts, c.latent, c.moe_inter
        self.w1 = nn.Parameter(torch.randn(E, mi, lat) / math.sqrt(lat))
        self.w3 = nn.Parameter(torch.randn(E, mi, lat) / math.sqrt(lat))
        self.w2 = nn.Parameter(torch.randn(E, lat, mi) / math.sqrt(mi) * 0.5)


class MoE(nn.Module):
    def __init__(self, c: NanoConfig):
        super().__init__()
        H = c.hidden
        self.c = c
        self.gate = nn.Parameter(torch.randn(c.experts, H) / math.sqrt(H))
        self.register_buffer("e_score_correction_bias", torch.zeros(c.experts))
        self.routed_expert_down_proj = _linear(c.latent, H)
        self.routed_expert_norm = nn.Parameter(torch.ones(c.latent))
        self.routed_expert_up_proj = nn.Parameter(torch.randn(H, c.latent) / math.sqrt(c.latent) * 0.5)
        self.experts = Experts(c)
        self.shared_experts = GLU(H, c.shared * c.moe_inter, c) if c.shared > 0 else None
        self.fake_quant = False
        self.last_load: Optional[torch.Tensor] = None  # tokens per expert of the last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        B, T, H = x.shape
        xf = x.reshape(-1, H)
        N = xf.shape[0]
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        scores = torch.sigmoid((xf @ self.gate.T).to(dt))  # [N, E]
        sel = torch.topk(scores + self.e_score_correction_bias, c.topk, dim=-1).indices
        ws = torch.gather(scores, 1, sel)
        ws = ws / (ws.sum(-1, keepdim=True) + 1e-20)
        z = xf @ self.routed_expert_down_proj.T  # [N, latent]
        # Group the (token, slot) pairs by expert into a padded [E, cap, latent] batch: three
        # batched matmuls instead of a loop over experts (padding rows are zero and give zero).
        flat_e = sel.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        flat_e = flat_e[order]
        flat_t = torch.arange(N, device=x.device).repeat_interleave(c.topk)[order]
        flat_w = ws.reshape(-1)[order]
        counts = torch.bincount(flat_e, minlength=c.experts)
        self.last_load = counts.detach()
        cap = int(counts.max())
        pos = torch.arange(flat_e.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[flat_e]
        ex = self.experts
        w1, w3, w2 = ex.w1, ex.w3, ex.w2
        if self.fake_quant:
            w1 = mxfp4_fake_quant(w1.reshape(-1, w1.shape[-1])).view_as(w1)
            w3 = mxfp4_fake_quant(w3.reshape(-1, w3.shape[-1])).view_as(w3)
            w2 = mxfp4_fake_quant(w2.reshape(-1, w2.shape[-1])).view_as(w2)
        zpad = torch.zeros(c.experts, cap, c.latent, device=x.device, dtype=z.dtype)
        zpad = zpad.index_put((flat_e, pos), z[flat_t])
        h = situ(torch.bmm(zpad, w1.to(z.dtype).transpose(1, 2)), torch.bmm(zpad, w3.to(z.dtype).transpose(1, 2)),
                 c.situ_beta, c.situ_linear_beta)
        y = torch.bmm(h, w2.to(z.dtype).transpose(1, 2))  # [E, cap, latent]
        contrib = y[flat_e, pos].to(dt) * flat_w.unsqueeze(-1)
        agg = torch.zeros(N, c.latent, device=x.device, dtype=dt).index_add(0, flat_t, contrib)
        agg = rms_norm(agg, self.routed_expert_norm.to(dt), c.eps).to(x.dtype)
        out = agg @ self.routed_expert_up_proj.T
        if self.shared_experts is not None:
            out = out + self.shared_experts(xf)
        return out.view(B, T, H)

    @torch.no_grad()
    def update_bias(self, rate: float):
        """Aux-loss-free balancing (DeepSeek-V3): raise the bias of under-loaded experts."""
        if self.last_load is None:
            return
        load = self.last_load.float()
        self.e_score_correction_bias += rate * torch.sign(load.mean() - load)


class Layer(nn.Module):
    def __init__(self, c: NanoConfig, L: int):
        super().__init__()
        H = c.hidden
        self.L = L
        self.is_kda = c.is_kda(L)
        self.self_attention_res = AttnResSite(H)
        self.mlp_res = AttnResSite(H)
        self.input_layernorm = nn.Parameter(torch.ones(H))
        self.post_attention_layernorm = nn.Parameter(torch.ones(H))
        self.self_attn = KDA(c) if self.is_kda else MLA(c)
        if L < c.first_dense:
            self.mlp = GLU(H, c.dense_inter, c)
            self.block_sparse_moe = None
        else:
            self.mlp = None
            self.block_sparse_moe = MoE(c)


class K3Model(nn.Module):
    def __init__(self, c: NanoConfig):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Parameter(torch.randn(c.vocab, c.hidden))
        self.layers = nn.ModuleList([Layer(c, L) for L in range(c.layers)])
        self.norm = nn.Parameter(torch.ones(c.hidden))
        self.output_attn_res = AttnResSite(c.hidden)
        self.lm_head = nn.Parameter(torch.randn(c.vocab, c.hidden) / math.sqrt(c.hidden))
        self.kda_chunk = 32
        self.kda_recurrent = False

    def set_fake_quant(self, on: bool):
        for l in self.layers:
            if l.block_sparse_moe is not None:
                l.block_sparse_moe.fake_quant = on

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> final normed hidden [B, T, H] (spec §3.3 steps 1-7 per layer)."""
        c = self.c
        P: Optional[torch.Tensor] = self.embed_tokens[ids]
        Bs: List[torch.Tensor] = []
        for lay in self.layers:
            L = lay.L
            a = lay.self_attention_res(Bs + [P], c.eps) if Bs else P
            if L % c.block == 0:
                Bs.append(P)
                P = None
            h = rms_norm(a, lay.input_layernorm, c.eps)
            if lay.is_kda:
                y = lay.self_attn(h, chunk=self.kda_chunk, recurrent=self.kda_recurrent)
            else:
                y = lay.self_attn(h)
            P = y if P is None else P + y
            m = lay.mlp_res(Bs + [P], c.eps)
            h2 = rms_norm(m, lay.post_attention_layernorm, c.eps)
            z = lay.mlp(h2) if lay.mlp is not None else lay.block_sparse_moe(h2)
            P = P + z
        hf = self.output_attn_res(Bs + [P], c.eps)
        return rms_norm(hf, self.norm, c.eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hidden_states(ids) @ self.lm_head.T


# ------------------------------------------------------------------------------------ config


def config_from_json(cfg: dict) -> NanoConfig:
    """A released config.json (nested or flat) -> NanoConfig. Only what the model needs."""
    t = cfg.get("text_config", cfg)
    la = t["linear_attn_config"]
    return NanoConfig(
        vocab=t["vocab_size"], hidden=t["hidden_size"], layers=t["num_hidden_layers"],
        mla_layers=list(la["full_attn_layers"]), block=t["attn_res_block_size"],
        kda_heads=la["num_heads"], kda_dim=la["head_dim"], conv=la["short_conv_kernel_size"],
        gate_lower_bound=la["gate_lower_bound"], mla_heads=t["num_attention_heads"], q_lora=t["q_lora_rank"],
        kv_lora=t["kv_lora_rank"], nope=t["qk_nope_head_dim"], rope=t["qk_rope_head_dim"], v=t["v_head_dim"],
        dense_inter=t["intermediate_size"], first_dense=t["first_k_dense_replace"], experts=t["num_experts"],
        topk=t["num_experts_per_token"], shared=t["num_shared_experts"], moe_inter=t["moe_intermediate_size"],
        latent=t["routed_expert_hidden_size"], situ_beta=t["activation_situ_beta"],
        situ_linear_beta=t["activation_situ_linear_beta"], eps=t["rms_norm_eps"],
        max_positions=t["max_position_embeddings"])


# ------------------------------------------------------------------------------------ names


PREFIX = "language_model.model."
HEAD = "language_model.lm_head.weight"


def released_name(param: str) -> Optional[str]:
    """Module parameter name -> released checkpoint name (experts handled separately)."""
    n = param
    for site in ("self_attention_res", "mlp_res", "output_attn_res"):
        n = n.replace(f"{site}.norm", f"{site}_norm.weight").replace(f"{site}.proj", f"{site}_proj.weight")
    if n == "lm_head":
        return HEAD
    if ".experts.w" in n:
        return None
    if n.endswith("e_score_correction_bias"):
        return PREFIX + n.replace("block_sparse_moe.e_score", "block_sparse_moe.gate.e_score")
    if n.endswith(("A_log", "dt_bias", "_norm.weight", "_proj.weight")):
        return PREFIX + n
    if n.endswith(("_conv1d", "_proj", "_mqa", "gate", "o_norm", "layernorm", "embed_tokens", "norm")):
        return PREFIX + n + ".weight"
    return PREFIX + n


def load_released(model: K3Model, tensors: Dict[str, torch.Tensor]) -> None:
    """Fills a K3Model from released-layout tensors (MXFP4 experts dequantised)."""
    from_state = {}
    for pname, p in list(model.named_parameters()) + list(model.named_buffers()):
        if ".experts.w" in pname:
            continue
        rn = released_name(pname)
        if rn not in tensors:
            raise KeyError(f"{rn} (for {pname}) not in checkpoint")
        t = tensors[rn]
        if t.dtype == torch.uint8:
            raise ValueError(rn)
        from_state[pname] = t.float().reshape(p.shape)
    with torch.no_grad():
        for pname, t in from_state.items():
            obj = model.get_parameter(pname) if pname in dict(model.named_parameters()) else model.get_buffer(pname)
            obj.copy_(t)
        for lay in model.layers:
            if lay.block_sparse_moe is None:
                continue
            ex = lay.block_sparse_moe.experts
            for e in range(model.c.experts):
                for which in ("w1", "w2", "w3"):
                    base = f"{PREFIX}layers.{lay.L}.block_sparse_moe.experts.{e}.{which}"
                    if base + ".weight_packed" in tensors:
                        pk, sc = tensors[base + ".weight_packed"], tensors[base + ".weight_scale"]
                        codes = torch.empty(pk.shape[0], pk.shape[1] * 2, dtype=torch.long)
                        codes[:, 0::2] = pk.long() & 15
                        codes[:, 1::2] = pk.long() >> 4
                        w = mxfp4_dequant(codes, sc.long())
                    else:
                        w = tensors[base + ".weight"].float()
                    getattr(ex, which)[e].copy_(w)
