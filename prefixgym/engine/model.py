"""The built-in LLaMA-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

One `Transformer` serves three callers: the trainer (a plain causal forward with
gradients), the sampler's prefill and its decode steps (a forward that hands each
layer's new keys/values to a `KVView` and attends to whatever the view returns).
The numerics match Hugging Face Llama/Qwen2 (rotate-half RoPE, fp32 RMSNorm), so a
local checkpoint of either loads 1:1 (see `hf_checkpoint.py`).

This module does not know where keys and values are stored, how requests are
batched, what a token means, or how the weights were trained: cache layout belongs
to the `KVView` owner (the scheduler), tokens to the tokenizer.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "PRESETS",
    "KVView",
    "ModelConfig",
    "Transformer",
    "count_parameters",
    "init_weights",
    "load_model",
]


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a `Transformer`; validated on construction."""

    vocab_size: int
    """Number of token ids the embedding and output head cover."""
    dim: int
    """Width of the residual stream (HF `hidden_size`)."""
    n_layers: int
    """Number of decoder blocks."""
    n_heads: int
    """Query heads per attention layer."""
    n_kv_heads: int
    """Key/value heads per layer; `n_heads` must be a multiple of it (GQA)."""
    hidden_dim: int
    """Width of the SwiGLU MLP (HF `intermediate_size`)."""
    max_seq_len: int = 2048
    """Longest position the RoPE tables cover; positions must be below it."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    tie_embeddings: bool = False
    """Whether the output head reuses the token embedding matrix."""
    qkv_bias: bool = False
    """Whether the q/k/v projections have a bias (Qwen2; Llama `attention_bias`)."""
    out_bias: bool = False
    """Whether the attention output projection has a bias (Llama `attention_bias`)."""
    head_dim_override: int | None = None
    """Per-head width when it is not `dim // n_heads` (HF `head_dim`)."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "hidden_dim",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"ModelConfig.n_heads={self.n_heads} must be a multiple of "
                f"n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim_override is None and self.dim % self.n_heads != 0:
            raise ValueError(
                f"ModelConfig.dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                "set head_dim_override"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelConfig head_dim={self.head_dim} must be even for RoPE")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"ModelConfig.rope_theta must be positive, got {self.rope_theta!r}")
        if not (self.norm_eps > 0):
            raise ValueError(f"ModelConfig.norm_eps must be positive, got {self.norm_eps!r}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        if self.head_dim_override is not None:
            return self.head_dim_override
        return self.dim // self.n_heads


PRESETS: dict[str, ModelConfig] = {
    # ~5.3M parameters; few layers because per-layer Python overhead dominates decode.
    "tiny": ModelConfig(
        vocab_size=4096,
        dim=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=768,
        max_seq_len=2048,
    ),
    # ~29M parameters.
    "small": ModelConfig(
        vocab_size=4096,
        dim=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=2,
        hidden_dim=1536,
        max_seq_len=2048,
    ),
}


class KVView(Protocol):
    """Where one forward's keys and values go, owned by the caller (the scheduler).

    `update` is called once per attention layer, in layer order, with the new keys
    (already rotated by RoPE) and values of the tokens in this forward. It stores them
    and returns every key/value the queries may look at plus a bool mask, True where
    query t of row b may attend key j, broadcastable to (B, 1, T, Tk). The mask must
    let every query row see at least one key (e.g. a padding query its own key):
    a fully masked row yields NaN, which would then be stored as a key/value.
    """

    def update(
        self, layer_idx: int, k_B_Hkv_T_D: torch.Tensor, v_B_Hkv_T_D: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store the new keys/values; return (k_B_Hkv_Tk_D, v_B_Hkv_Tk_D, mask)."""
        ...


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF-exact RMSNorm: normalise in fp32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF convention): x (B, H, T, D), cos/sin (B, 1, T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        qkv_out = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        # q, k and v in one matmul; rows ordered [q | k | v] like HF's three projections.
        self.wqkv = nn.Linear(config.dim, qkv_out, bias=config.qkv_bias)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=config.out_bias)

    def forward(
        self, x_B_T_C: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVView | None
    ) -> torch.Tensor:
        B, T, _ = x_B_T_C.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x_B_T_C).view(B, T, H + 2 * Hkv, D).transpose(1, 2)  # (B, H+2Hkv, T, D)
        qk = _apply_rope(qkv[:, : H + Hkv], cos, sin)  # rotate q and k in one op
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + Hkv :]
        if kv is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hkv != H)
        else:
            k_all, v_all, mask = kv.update(self.layer_idx, k, v)
            y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=Hkv != H)
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

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVView | None
    ) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), cos, sin, kv)
        return h + self.mlp(self.mlp_norm(h))


class Transformer(nn.Module):
    """Decoder-only LM. `forward` returns float32 logits whatever the weight dtype."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output: nn.Linear | None = (
            None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        )
        self.build_rope_tables()

    def build_rope_tables(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the cos/sin tables, (max_seq_len, head_dim), as HF does in fp32.

        Not part of the state dict; call again after materialising a meta-device model.
        """
        cfg = self.config
        D = cfg.head_dim
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D)
        )
        positions = torch.arange(cfg.max_seq_len, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)  # (S, D/2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (S, D)
        dtype = self.tok_embeddings.weight.dtype
        if not dtype.is_floating_point or self.tok_embeddings.weight.is_meta:
            dtype = torch.float32
        self.register_buffer("rope_cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("rope_sin", angles.sin().to(dtype), persistent=False)

    @property
    def output_weight(self) -> torch.Tensor:
        """The (V, C) output head matrix (the embedding when tied)."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(
        self,
        tokens_B_T: torch.Tensor,
        positions_B_T: torch.Tensor | None = None,
        kv: KVView | None = None,
        last_only: bool = False,
        last_index_B: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V) in float32, or (B, 1, V) with `last_only`.

        With `kv=None` this is causal attention over `tokens_B_T` alone (right padding
        is harmless) and positions default to arange(T). With a `kv`, every layer
        attends to what `kv.update` returns, under its mask. `last_index_B` picks, with
        `last_only`, position `last_index_B[b]` of row b instead of T-1.
        """
        if tokens_B_T.dim() != 2:
            raise ValueError(f"tokens_B_T must be 2-D (B, T), got shape {tuple(tokens_B_T.shape)}")
        B, T = tokens_B_T.shape
        cfg = self.config
        if T == 0:
            raise ValueError("tokens_B_T has no positions (T == 0)")
        lo, hi = torch.aminmax(tokens_B_T)
        if int(lo) < 0 or int(hi) >= cfg.vocab_size:
            raise ValueError(
                f"token id out of range [0, {cfg.vocab_size}): min {int(lo)}, max {int(hi)}"
            )
        if positions_B_T is None:
            if T > cfg.max_seq_len:
                raise ValueError(f"sequence length {T} exceeds max_seq_len={cfg.max_seq_len}")
            cos = self.rope_cos[:T]  # (T, D) broadcasts over (B, H)
            sin = self.rope_sin[:T]
        else:
            if positions_B_T.shape != tokens_B_T.shape:
                raise ValueError(
                    f"positions_B_T shape {tuple(positions_B_T.shape)} != tokens_B_T shape "
                    f"{tuple(tokens_B_T.shape)}"
                )
            plo, phi = torch.aminmax(positions_B_T)
            if int(plo) < 0 or int(phi) >= cfg.max_seq_len:
                raise ValueError(
                    f"position out of range [0, {cfg.max_seq_len}): min {int(plo)}, max {int(phi)}"
                )
            cos = self.rope_cos[positions_B_T].unsqueeze(1)  # (B, 1, T, D)
            sin = self.rope_sin[positions_B_T].unsqueeze(1)

        h = self.tok_embeddings(tokens_B_T)  # (B, T, C)
        for layer in self.layers:
            h = layer(h, cos, sin, kv)
        if last_only:
            if last_index_B is None:
                h = h[:, -1:]  # (B, 1, C)
            else:
                h = h[torch.arange(B, device=h.device), last_index_B].unsqueeze(1)
        h = self.norm(h)
        return F.linear(h, self.output_weight).float()  # (B, T, V)

    def clone_for_inference(self, dtype: torch.dtype | None = None) -> Transformer:
        """A frozen deep copy (eval mode, requires_grad False) for sampling."""
        clone = copy.deepcopy(self)
        if dtype is not None:
            clone.to(dtype)
            clone.build_rope_tables(clone.rope_cos.device)
        clone.requires_grad_(False)
        return clone.eval()

    def copy(self) -> Transformer:
        """Alias of `clone_for_inference()`."""
        return self.clone_for_inference()

    @torch.no_grad()
    def load_weights_from(self, other: Transformer) -> None:
        """Copy `other`'s weights into this model in place (shapes must match)."""
        if other.config != self.config:
            raise ValueError("load_weights_from: configs differ")
        mine = dict(self.named_parameters())
        for name, param in other.named_parameters():
            mine[name].copy_(param)


def count_parameters(model: nn.Module, non_embedding: bool = False) -> int:
    """Number of distinct parameters (tied ones once); `non_embedding` leaves out the
    token embedding and the output head."""
    params = {id(p): p for p in model.parameters()}
    if non_embedding and isinstance(model, Transformer):
        params.pop(id(model.tok_embeddings.weight), None)
        params.pop(id(model.output_weight), None)
    return sum(p.numel() for p in params.values())


@torch.no_grad()
def init_weights(model: Transformer, seed: int = 0) -> None:
    """Normal(0, 0.02) init, residual output projections scaled by 1/sqrt(2 n_layers),
    biases zero, norms one. Uses its own generator: the global RNG is untouched."""
    gen = torch.Generator().manual_seed(seed)
    std = 0.02
    residual_std = std / math.sqrt(2 * model.config.n_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            s = residual_std if name.endswith(("wo.weight", "w_down.weight")) else std
            param.copy_(torch.randn(param.shape, generator=gen) * s)


def load_model(
    name_or_dir: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    *,
    max_seq_len: int | None = None,
) -> Transformer:
    """A preset name ("tiny", "small") → a seeded random model; a local HF Llama/Qwen2
    directory (config.json + *.safetensors) → that checkpoint. Returned in train mode."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    name = os.fspath(name_or_dir)
    if name in PRESETS:
        config = PRESETS[name]
        if max_seq_len is not None:
            config = dataclasses.replace(config, max_seq_len=max_seq_len)
        with torch.device("meta"):  # skip nn.Linear's init, which draws from the global RNG
            model = Transformer(config)
        model.to_empty(device="cpu")
        init_weights(model, seed)
        model.to(dtype)
        model.build_rope_tables(torch.device("cpu"))
        return model
    if os.path.isdir(name):
        from prefixgym.engine.hf_checkpoint import load_hf_checkpoint

        return load_hf_checkpoint(name, dtype=dtype, max_seq_len=max_seq_len)
    raise ValueError(
        f"unknown model {name!r}: not a preset ({', '.join(sorted(PRESETS))}) "
        "and not a local directory"
    )
