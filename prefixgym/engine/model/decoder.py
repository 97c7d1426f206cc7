"""The built-in LLaMA-style decoder: embeddings, RoPE tables, a stack of blocks, the head.

One `Transformer` serves three callers: the trainer (a plain causal forward with
gradients, or, for datums sharing token prefixes, one forward per wave of a prefix
trie through a `KVView` that keeps keys/values in the autograd graph), the sampler's
prefill and its decode steps (a forward that hands each layer's new keys/values to a
`KVView` and attends to whatever the view returns).
Every supported family runs through it, the config's knobs saying what differs (the
embedding and logit multipliers here, the rest in the blocks); the numerics match
transformers' (rotate-half RoPE, fp32 RMSNorm), so a local checkpoint loads 1:1 (see
`families.py`, `hf_checkpoint.py`). The layers live in `layers.py`, the config and
presets in `config.py`, the RoPE tables in `rope.py`; `loading.py` builds a model from
a preset name or a checkpoint directory.

This module does not know where keys and values are stored, how requests are
batched, what a token means, or how the weights were trained: cache layout belongs
to the `KVView` owner (the scheduler), tokens to the tokenizer.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from prefixgym.engine.model.config import ModelConfig, RopeScaling
from prefixgym.engine.model.layers import Block, KVView, RMSNorm
from prefixgym.engine.model.rope import rope_tables

__all__ = ["Transformer", "count_parameters", "init_weights"]


class Transformer(nn.Module):
    """Decoder-only LM. `forward` returns float32 logits whatever the weight dtype."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    local_rope_cos: torch.Tensor | None
    local_rope_sin: torch.Tensor | None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, config.norm_offset,
                            config.norm_scale_in_fp32)
        self.output: nn.Linear | None = (
            None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        )
        self.head_adapter: nn.Module | None = None
        """A LoRA adapter on the output head (`lora.py`): its output is added to the logits."""
        self.head_linear: nn.Module | None = None
        """The output matrix as a layer of an inference copy (`packed.py`): `head` calls it
        instead of `F.linear` on `output_weight`."""
        self.narrow_steps = False
        """Whether a decode step may run narrow (`wide_ops.py`): every matmul of it runs
        wide, which `packed.py` says of an inference copy it packed whole."""
        self.hf_config: dict[str, Any] | None = None
        """The config.json it was loaded from (`hf_checkpoint.py`), which `hf_export.py`
        writes back; None for a preset or a config built here."""
        self.build_rope_tables()

    def build_rope_tables(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the cos/sin tables, (max_seq_len, rotary_width), as HF does in fp32
        (scaled as the config says: `rope.py`), in the weights' dtype.

        Not part of the state dict; call again after materialising a meta-device model.
        """
        dtype = self.tok_embeddings.weight.dtype
        if (not dtype.is_floating_point or self.tok_embeddings.weight.is_meta
                or self.config.rope_in_fp32):  # (OLMo's rotation runs in fp32)
            dtype = torch.float32
        cos, sin = rope_tables(self.config, dtype, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        local: tuple[torch.Tensor | None, ...] = (None, None)
        if self.config.local_rope_theta is not None:  # the windowed layers' own (Gemma 3)
            local = rope_tables(dataclasses.replace(
                self.config, rope_theta=self.config.local_rope_theta,
                rope_scaling=RopeScaling()), dtype, device)
        self.register_buffer("local_rope_cos", local[0], persistent=False)
        self.register_buffer("local_rope_sin", local[1], persistent=False)

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
        recompute: bool = False,
        check_inputs: bool = True,
    ) -> torch.Tensor:
        """Logits (B, T, V) in float32, or (B, 1, V) with `last_only`: `head(hidden(...))`.

        With `kv=None` this is causal attention over `tokens_B_T` alone (right padding
        is harmless) and positions default to arange(T). With a `kv`, every layer
        attends to what `kv.update` returns, under its mask. `last_index_B` picks, with
        `last_only`, position `last_index_B[b]` of row b instead of T-1. `recompute` and
        `check_inputs`: see `hidden`.
        """
        return self.head(self.hidden(tokens_B_T, positions_B_T, kv, last_only, last_index_B,
                                     recompute, check_inputs))

    def hidden(
        self,
        tokens_B_T: torch.Tensor,
        positions_B_T: torch.Tensor | None = None,
        kv: KVView | None = None,
        last_only: bool = False,
        last_index_B: torch.Tensor | None = None,
        recompute: bool = False,
        check_inputs: bool = True,
    ) -> torch.Tensor:
        """The final norm's output (B, T, C) (or (B, 1, C) with `last_only`): what `head`
        turns into logits. Arguments as `forward`.

        `recompute` (with gradients enabled) checkpoints every block: backward keeps only
        each block's input and runs the block's forward again to get the rest, so the
        activations held for backward shrink from every block's to one block's at a time,
        for one more forward of the blocks. The gradients are the same (the recomputed
        forward repeats the same ops on the same inputs); a `kv` must give the same
        keys/values when a layer calls it again (`shared_forward.TrieKV` does).
        `check_inputs=False` skips the range checks, which wait for the device (the
        sampler's runner passes it: the engine validated every request at submit).
        """
        B, T = tokens_B_T.shape if tokens_B_T.dim() == 2 else (0, 0)
        cfg = self.config
        positions_B_T = self.checked_positions(tokens_B_T, positions_B_T, check_inputs)
        if positions_B_T.dim() == 2:
            positions_B_T = positions_B_T.unsqueeze(1)  # (B, 1, T): broadcasts over heads
        rope = (self.rope_cos[positions_B_T], self.rope_sin[positions_B_T])  # (B, 1, T, D)
        local_rope = rope
        if self.local_rope_cos is not None and self.local_rope_sin is not None:
            local_rope = (self.local_rope_cos[positions_B_T], self.local_rope_sin[positions_B_T])

        packing = getattr(kv, "packing", None)  # (the real tokens of a padded batch)
        if packing is not None:
            tokens_B_T = packing.pack(tokens_B_T.unsqueeze(-1)).squeeze(-1)  # (1, M)
        h = self.tok_embeddings(tokens_B_T)  # (B, T, C), or (1, M, C) packed
        if cfg.embedding_multiplier != 1.0:
            multiplier: float | torch.Tensor = cfg.embedding_multiplier
            if cfg.embedding_multiplier_rounded:  # Gemma: a tensor in the weights' dtype
                multiplier = torch.tensor(multiplier, device=h.device).to(h.dtype)  # via fp32
            h = h * multiplier
        checkpointed = recompute and torch.is_grad_enabled()
        for layer in self.layers:
            cos, sin = local_rope if layer.attn.local_rope else rope  # type: ignore[union-attr]
            if checkpointed:
                h = checkpoint(layer, h, cos, sin, kv, use_reentrant=False,
                               preserve_rng_state=False)  # no randomness in a block
            else:
                h = layer(h, cos, sin, kv)
        if packing is not None:
            if last_only and last_index_B is not None:  # each row's last real token
                last = torch.arange(B, device=h.device) * T + last_index_B
                return self.norm(h[0, torch.searchsorted(packing.index_M, last)].unsqueeze(1))
            h = packing.unpack(h)
        if last_only:
            if last_index_B is None:
                h = h[:, -1:]  # (B, 1, C)
            else:
                h = h[torch.arange(B, device=h.device), last_index_B].unsqueeze(1)
        return self.norm(h)

    def checked_positions(self, tokens_B_T: torch.Tensor, positions_B_T: torch.Tensor | None,
                          check_inputs: bool = True) -> torch.Tensor:
        """`positions_B_T`, or arange(T) (T,) when None, once the tokens and positions are
        checked: a 2-D batch, ids in the vocabulary, positions below max_seq_len (the
        range checks wait for the device: `check_inputs=False` skips them). ValueError."""
        if tokens_B_T.dim() != 2:
            raise ValueError(f"tokens_B_T must be 2-D (B, T), got shape {tuple(tokens_B_T.shape)}")
        T = tokens_B_T.shape[1]
        cfg = self.config
        if T == 0:
            raise ValueError("tokens_B_T has no positions (T == 0)")
        lo, hi = torch.aminmax(tokens_B_T) if check_inputs else (0, 0)
        if int(lo) < 0 or int(hi) >= cfg.vocab_size:
            raise ValueError(
                f"token id out of range [0, {cfg.vocab_size}): min {int(lo)}, max {int(hi)}"
            )
        if positions_B_T is None:
            if T > cfg.max_seq_len:
                raise ValueError(f"sequence length {T} exceeds max_seq_len={cfg.max_seq_len}")
            return torch.arange(T, device=tokens_B_T.device)  # (T,): broadcasts
        if positions_B_T.shape != tokens_B_T.shape:
            raise ValueError(
                f"positions_B_T shape {tuple(positions_B_T.shape)} != tokens_B_T shape "
                f"{tuple(tokens_B_T.shape)}"
            )
        plo, phi = torch.aminmax(positions_B_T) if check_inputs else (0, 0)
        if int(plo) < 0 or int(phi) >= cfg.max_seq_len:
            raise ValueError(
                f"position out of range [0, {cfg.max_seq_len}): min {int(plo)}, max {int(phi)}"
            )
        return positions_B_T

    def head(self, h_N_C: torch.Tensor) -> torch.Tensor:
        """Float32 logits (..., V) of final-norm outputs (..., C): the output matrix, plus
        the head's LoRA adapter when there is one."""
        head = self.head_linear
        logits = head(h_N_C) if head is not None else F.linear(h_N_C, self.output_weight)
        if self.head_adapter is not None:
            logits = logits + self.head_adapter(h_N_C)
        if self.config.logit_divisor != 1.0:  # Granite's logits_scaling
            logits = logits / self.config.logit_divisor
        if self.config.final_softcap is not None:  # Gemma 2
            cap = self.config.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def attends_shared_keys(self) -> bool:
        """Whether a one-query forward may hand some keys as `SharedKeys` (shared_attention.py):
        SDPA's attention in every layer (no soft cap, no sink), no sliding window."""
        return bool(self.layers) and all(
            isinstance(block, Block) and block.attn.takes_shared_keys for block in self.layers)

    def clone_for_inference(self, dtype: torch.dtype | None = None) -> Transformer:
        """A frozen deep copy (eval mode, requires_grad False) for sampling."""
        clone = copy.deepcopy(self)
        if dtype is not None:
            clone.to(dtype)
            clone.build_rope_tables(clone.output_weight.device)
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
    biases zero, norms one (Gemma's offset norms zero). Uses its own generator: the global
    RNG is untouched."""
    gen = torch.Generator().manual_seed(seed)
    std = 0.02
    residual_std = std / math.sqrt(2 * model.config.n_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(0.0 if model.config.norm_offset else 1.0)  # (1 + w) norms: w = 0
        elif name.endswith(".bias"):
            param.zero_()
        else:
            s = residual_std if name.endswith(("wo.weight", "w_down.weight")) else std
            param.copy_(torch.randn(param.shape, generator=gen) * s)
