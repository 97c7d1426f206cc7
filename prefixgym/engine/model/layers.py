"""The decoder's building blocks: RMSNorm, RoPE, grouped-query attention, SwiGLU.

`Block` is one decoder layer, its norms before each sublayer (or, with `post_norms`,
after it: OLMo 2), each sublayer's output scaled by `residual_multiplier` (Granite);
its `Attention` normalises queries and keys where the config says (Qwen3 per head,
OLMo 2 over all heads), rotates them with the caller's cos/sin tables (the first
`rotary_width` dims; not at all in a layer without RoPE: SmolLM3) and either attends
causally over the forward's own tokens or hands the new keys/values to a `KVView` and
attends to whatever the view returns.
A bf16/fp16 model whose keys/values the caller keeps in fp32 (the scheduler does)
attends in fp32: on CPU, SDPA's fp32 kernel is as fast as its bf16 one at prefill and
several times faster for one-query decode steps, and the scores stay exact.
Numerics follow Hugging Face's (rotate-half RoPE, fp32 RMSNorm) for every family (`families.py`).

This module does not know where keys and values are stored (the `KVView` owner's
business), how the RoPE tables are built or which positions they cover (the
`Transformer`'s), nor anything of tokens, embeddings or the output head.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from prefixgym.engine.model.config import ModelConfig

__all__ = ["Attention", "Block", "KVView", "RMSNorm", "SwiGLU"]


class KVView(Protocol):
    """Where one forward's keys and values go, owned by the caller (the scheduler's KV
    slots, or the training client's `shared_forward.TrieKV`).

    `update` is called once per attention layer, in layer order, with the new keys
    (already rotated by RoPE) and values of the tokens in this forward. It stores them
    and returns every key/value the queries may look at plus a mask, broadcastable to
    (B, 1, T, Tk): bool (True where query t of row b may attend key j) or additive
    (0 there, -inf elsewhere) in the keys' dtype. The mask must
    let every query row see at least one key (e.g. a padding query its own key):
    a fully masked row yields NaN, which would then be stored as a key/value.
    The mask may be None when it is plain causal (T == Tk, query t sees keys <= t),
    which lets the attention kernel skip the masked half, or, for one query per row
    (T == 1), when every row sees every key returned. The returned keys/values may
    be float32 for a bf16/fp16 model; attention then runs in float32.
    """

    def update(
        self, layer_idx: int, k_B_Hkv_T_D: torch.Tensor, v_B_Hkv_T_D: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store the new keys/values; return (k_B_Hkv_Tk_D, v_B_Hkv_Tk_D, mask or None)."""
        ...


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF-exact RMSNorm: normalise in fp32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # fused fp32 norm: bit-identical to HF's x * rsqrt(mean(x^2) + eps) (checked), fewer ops
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF convention): x (B, H, T, D), cos/sin (B, 1, T, R), with `sin`
    negated on its first half (`Transformer.rope_sin`): HF's x*cos + cat(-x2, x1)*sin in
    three kernels instead of five, and the same bits, forward and backward (a sign flip
    is exact). With R < D (partial rotary) the first R dims turn, the rest pass."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + x.roll(rotary // 2, -1) * sin
    turned = x[..., :rotary]
    return torch.cat((turned * cos + turned.roll(rotary // 2, -1) * sin, x[..., rotary:]), -1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.rope = config.uses_rope(layer_idx)
        self.scale = config.attention_scale  # None: SDPA's 1/sqrt(head_dim)
        self.qk_norm = config.qk_norm
        qkv_out = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        # q, k and v in one matmul; rows ordered [q | k | v] like HF's three projections.
        self.wqkv = nn.Linear(config.dim, qkv_out, bias=config.qkv_bias)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=config.out_bias)
        if config.qk_norm != "none":
            heads = (config.n_heads, config.n_kv_heads) if config.qk_norm == "all_heads" else (1, 1)
            self.q_norm = RMSNorm(heads[0] * config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(heads[1] * config.head_dim, config.norm_eps)

    def forward(
        self, x_B_T_C: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVView | None
    ) -> torch.Tensor:
        B, T, _ = x_B_T_C.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        proj = self.wqkv(x_B_T_C)  # (B, T, (H+2Hkv)*D)
        if self.qk_norm == "all_heads":  # over every head's width at once (OLMo 2)
            q, k, v = proj.split([H * D, Hkv * D, Hkv * D], dim=-1)
            proj = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)
        qkv = proj.view(B, T, H + 2 * Hkv, D).transpose(1, 2)  # (B, H+2Hkv, T, D)
        qk = qkv[:, : H + Hkv]
        if self.qk_norm == "head":  # over each head's width (Qwen3)
            qk = torch.cat((self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])), dim=1)
        if self.rope:
            qk = _apply_rope(qk, cos, sin)  # rotate q and k in one op
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + Hkv :]
        if kv is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hkv != H,
                                               scale=self.scale)
        else:
            k_all, v_all, mask = kv.update(self.layer_idx, k, v)
            q_attn = q if k_all.dtype == q.dtype else q.to(k_all.dtype)  # fp32 KV: attend in fp32
            causal = mask is None and T > 1  # (one query and no mask: every key)
            y = F.scaled_dot_product_attention(
                q_attn, k_all, v_all, attn_mask=mask, is_causal=causal, enable_gqa=Hkv != H,
                scale=self.scale,
            ).to(q.dtype)
        return self.wo(y.transpose(1, 2).reshape(B, T, H * D))


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # gate and up in one matmul; rows ordered [gate | up].
        self.w_gate_up = nn.Linear(config.dim, 2 * config.hidden_dim, bias=False)
        self.w_down = nn.Linear(config.hidden_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = SwiGLU(config)
        self.post_norms = config.post_norms
        self.residual_multiplier = config.residual_multiplier

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVView | None
    ) -> torch.Tensor:
        if self.post_norms:  # OLMo 2: each norm on its sublayer's output
            attn = self.attn_norm(self.attn(h, cos, sin, kv))
        else:
            attn = self.attn(self.attn_norm(h), cos, sin, kv)
        h = h + (attn if self.residual_multiplier == 1.0 else attn * self.residual_multiplier)
        mlp = self.mlp_norm(self.mlp(h)) if self.post_norms else self.mlp(self.mlp_norm(h))
        return h + (mlp if self.residual_multiplier == 1.0 else mlp * self.residual_multiplier)
