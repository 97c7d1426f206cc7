"""The decoder's building blocks: RMSNorm, RoPE, grouped-query attention, the block.

`Block` is one decoder layer, its norms before each sublayer (or after it: OLMo 2, or
both: Gemma), each sublayer's output scaled by `residual_multiplier` (Granite);
its `Attention` normalises queries and keys where the config says (Qwen3 per head,
OLMo 2 over all heads), rotates them with the caller's cos/sin tables (the first
`rotary_width` dims; not at all in a layer without RoPE: SmolLM3) and either attends
causally over the forward's own tokens (within its sliding window, if it has one) or
hands the new keys/values to a `KVView` and attends to whatever the view returns,
under the view's mask for that layer. Scores that are soft-capped (Gemma 2) or share
their softmax with a sink (gpt-oss) take the plain matmul-softmax path, which SDPA
cannot express. The block's MLP is a `GatedMLP` or, in a mixture-of-experts layer, a
`MixtureOfExperts` (Qwen3-MoE's and gpt-oss's routing): both in mlp.py.
A bf16/fp16 model whose keys/values the caller hands in fp32 (the sampler's KV pool
does on CPU) attends in fp32: on CPU, SDPA's fp32 kernel is as fast as its bf16 one at
prefill and several times faster for one-query decode steps, and the scores stay exact.
A one-query step whose view shares keys among rows (`SharedKeys`) attends them by
`shared_attention.attend_shared`.
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
from prefixgym.engine.model.mlp import GatedMLP, MixtureOfExperts
from prefixgym.engine.model.shared_attention import FLASH_CPU, attend_shared
from prefixgym.engine.model.token_packing import Packing
from prefixgym.engine.model.wide_ops import wide

__all__ = ["Attention", "Block", "GatedMLP", "KVView", "MixtureOfExperts", "RMSNorm",
           "causal_window_mask", "window_allows"]


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

    A layer with a sliding window (`ModelConfig.window`) gets a mask that also hides the
    keys at or before its query's position minus the window (`window_allows`); the view
    knows each layer's window from the config it was built for.

    A view of a one-query forward may also have `shared(layer_idx)`, a list of
    `SharedKeys` (the sampler's, for a model that `attends_shared_keys`): `update` then
    returns each row's keys beyond those, and its attention is over both. A view of a
    padded forward may have `packing`, a `Packing` (or None): the layers then see only
    its real tokens but in attention (the sampler's prefill: no matmul on padding).
    """

    def update(
        self, layer_idx: int, k_B_Hkv_T_D: torch.Tensor, v_B_Hkv_T_D: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store the new keys/values; return (k_B_Hkv_Tk_D, v_B_Hkv_Tk_D, mask or None)."""
        ...


def window_allows(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """bool, broadcast of (..., T, 1) against (..., 1, Tk): True where a key lies within
    the query's window, positions (q - window, q] (transformers' sliding_window_overlay),
    without the causal half (key <= query), which the caller's mask has."""
    return key_pos.unsqueeze(-2) > query_pos.unsqueeze(-1) - window


def causal_window_mask(T: int, window: int, device: torch.device) -> torch.Tensor:
    """(T, T) bool: query t sees keys (t - window, t]."""
    pos = torch.arange(T, device=device)
    return (pos.unsqueeze(0) <= pos.unsqueeze(1)) & window_allows(pos, pos, window)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False,
              scale_in_fp32: bool = False) -> torch.Tensor:
    """HF-exact RMSNorm: normalise in fp32, cast back, then scale; with `offset`
    (Gemma), scale by 1 + weight in fp32, then cast; with `scale_in_fp32` (gpt-oss), scale
    by the weight in fp32, then cast."""
    if offset or (scale_in_fp32 and x.dtype != torch.float32):
        scale = 1.0 + weight.float() if offset else weight.float()
        return (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * scale).to(x.dtype)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # fused fp32 norm: bit-identical to HF's x * rsqrt(mean(x^2) + eps) (checked), fewer ops
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: bool = False,
                 scale_in_fp32: bool = False) -> None:
        super().__init__()
        self.eps, self.offset, self.scale_in_fp32 = eps, offset, scale_in_fp32
        # Gemma's weight is an offset from 1: its identity is 0
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps, self.offset, self.scale_in_fp32)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF convention): x (B, H, T, D), cos/sin (B, 1, T, R), with `sin`
    negated on its first half (`Transformer.rope_sin`): HF's x*cos + cat(-x2, x1)*sin in
    three kernels instead of five, and the same bits, forward and backward (a sign flip
    is exact). With R < D (partial rotary) the first R dims turn, the rest pass. fp32
    tables rotate a bf16 x in fp32 (OLMo's); the caller rounds back."""
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
        self.local_rope = config.uses_local_rope(layer_idx)
        """Whether it rotates with the windowed layers' own tables (`Transformer`'s pick)."""
        self.window = config.window(layer_idx)
        self.scale = config.attention_scale  # None: SDPA's 1/sqrt(head_dim)
        self.softcap = config.attention_softcap
        self.sinks: nn.Parameter | None = (
            nn.Parameter(torch.zeros(config.n_heads)) if config.attention_sinks else None)
        self.qk_norm = config.qk_norm
        qkv_out = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        # q, k and v in one matmul; rows ordered [q | k | v] like HF's three projections.
        self.wqkv = nn.Linear(config.dim, qkv_out, bias=config.qkv_bias)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=config.out_bias)
        if config.qk_norm != "none":
            heads = (config.n_heads, config.n_kv_heads) if config.qk_norm == "all_heads" else (1, 1)
            norm = (config.norm_eps, config.norm_offset, config.norm_scale_in_fp32)
            self.q_norm = RMSNorm(heads[0] * config.head_dim, *norm)
            self.k_norm = RMSNorm(heads[1] * config.head_dim, *norm)

    def forward(
        self, x_B_T_C: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVView | None
    ) -> torch.Tensor:
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        proj = self.wqkv(x_B_T_C)  # (B, T, (H+2Hkv)*D)
        packing: Packing | None = getattr(kv, "packing", None)
        if packing is not None:  # (1, M, C) in: the real tokens of a padded (B, T)
            proj = packing.unpack(proj)
        B, T, _ = proj.shape
        if self.qk_norm == "all_heads":  # over every head's width at once (OLMo 2)
            q, k, v = proj.split([H * D, Hkv * D, Hkv * D], dim=-1)
            proj = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)
        qkv = proj.view(B, T, H + 2 * Hkv, D).transpose(1, 2)  # (B, H+2Hkv, T, D)
        qk = qkv[:, : H + Hkv]
        if self.qk_norm == "head":  # over each head's width (Qwen3)
            qk = torch.cat((self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])), dim=1)
        if self.rope:
            qk = _apply_rope(qk, cos, sin).to(qk.dtype)  # rotate q and k in one op
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + Hkv :]
        if kv is None:
            mask = None  # plain causal, unless the window cuts within this forward
            if self.window and T > self.window:
                mask = causal_window_mask(T, self.window, x_B_T_C.device)
            y = self._attend(q, k, v, mask, causal=mask is None)
        else:
            k_all, v_all, mask = kv.update(self.layer_idx, k, v)
            q_attn = q if k_all.dtype == q.dtype else q.to(k_all.dtype)  # fp32 keys: attend in fp32
            causal = mask is None and T > 1  # (one query and no mask: every key)
            shared = kv.shared(self.layer_idx) if hasattr(kv, "shared") else []
            if shared:
                y = attend_shared(q_attn, k_all, v_all, mask, shared, self.scale).to(q.dtype)
            else:
                with wide():  # (a narrow decode step's attention: every thread)
                    y = self._attend(q_attn, k_all, v_all, mask, causal)
                y = y.to(q.dtype)
        y = y.transpose(1, 2).reshape(B, T, H * D)
        return self.wo(y if packing is None else packing.pack(y))

    @property
    def takes_shared_keys(self) -> bool:
        """Whether a view may hand this layer `SharedKeys`: plain softmax attention (no
        soft cap, no sink) over every key (no window), on a torch with SDPA's CPU flash
        kernel (the merge needs its log-sum-exp)."""
        return (FLASH_CPU is not None and self.softcap is None and self.sinks is None
                and not self.window)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """softmax(scale q k^T, masked) v, by SDPA; soft-capped scores, or a softmax with a
        sink logit per head (gpt-oss: it takes a share of the weight and adds no value), by
        the plain ops transformers' eager attention uses (scores in q's dtype, softmax in
        fp32)."""
        B, H, T, D = q.shape
        Hkv = k.shape[1]
        if self.softcap is None and self.sinks is None:
            if T == 1 and H != Hkv and not causal:  # a decode step under GQA
                # the H / Hkv query heads of one key/value head as that head's queries:
                # SDPA then reads each head's keys and values once, not once per query
                # head (3x less memory traffic at 12 / 4 heads; the same math)
                y = F.scaled_dot_product_attention(q.reshape(B, Hkv, H // Hkv, D), k, v,
                                                   attn_mask=mask, scale=self.scale)
                return y.reshape(B, H, 1, D)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                  enable_gqa=Hkv != H, scale=self.scale)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        if (self.sinks is not None and self.softcap is None and FLASH_CPU is not None
                and _flash_serves(q, mask)):
            # sampling on CPU: the flash kernel's output and log-sum-exp, the sink's share
            # taken out after (out x sigmoid(lse - sink)): 4x the plain ops at 4 x 512
            out, lse = FLASH_CPU(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)[:2]
            sink = self.sinks.to(lse.dtype).view(1, -1, 1)
            return out * torch.sigmoid(lse - sink).unsqueeze(-1).to(out.dtype)
        scores = torch.matmul(q, k.transpose(2, 3)) * scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if causal:
            T = q.shape[2]
            mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(mask.logical_not(), float("-inf"))
        elif mask is not None:
            scores = scores + mask
        if self.sinks is not None:  # (gpt-oss's softmax runs in the scores' dtype)
            B, H, T, _ = scores.shape
            sink = self.sinks.to(scores.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
            logits = torch.cat((scores, sink), dim=-1)
            logits = logits - logits.amax(dim=-1, keepdim=True)
            weights = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(q.dtype)
        else:
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, v)


def _flash_serves(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `FLASH_CPU` serves: no gradient, on CPU, fp32 (the sampler's KV; a bf16
    forward takes transformers' plain ops, to round as they do), an additive mask or
    none."""
    return (not torch.is_grad_enabled() and q.device.type == "cpu"
            and q.dtype == torch.float32 and (mask is None or mask.dtype == q.dtype))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        eps, offset, fp32 = config.norm_eps, config.norm_offset, config.norm_scale_in_fp32
        self.attn_norm = RMSNorm(config.dim, eps, offset, fp32)
        self.attn = Attention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.dim, eps, offset, fp32)
        self.mlp: GatedMLP | MixtureOfExperts = (
            MixtureOfExperts(config) if config.is_moe(layer_idx) else GatedMLP(config))
        if config.norms == "both":  # Gemma: a second norm on each sublayer's output
            self.attn_post_norm = RMSNorm(config.dim, eps, offset, fp32)
            self.mlp_post_norm = RMSNorm(config.dim, eps, offset, fp32)
        self.norms = config.norms
        self.residual_multiplier = config.residual_multiplier

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVView | None
    ) -> torch.Tensor:
        if self.norms == "post":  # OLMo 2: each norm on its sublayer's output
            attn = self.attn_norm(self.attn(h, cos, sin, kv))
        else:
            attn = self.attn(self.attn_norm(h), cos, sin, kv)
            if self.norms == "both":
                attn = self.attn_post_norm(attn)
        h = h + (attn if self.residual_multiplier == 1.0 else attn * self.residual_multiplier)
        if self.norms == "post":
            mlp = self.mlp_norm(self.mlp(h))
        else:
            mlp = self.mlp(self.mlp_norm(h))
            if self.norms == "both":
                mlp = self.mlp_post_norm(mlp)
        return h + (mlp if self.residual_multiplier == 1.0 else mlp * self.residual_multiplier)
