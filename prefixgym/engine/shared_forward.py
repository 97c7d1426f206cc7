"""Run a `TriePlan` through the model: each shared position once, per-datum logprobs.

1) Run the plan's waves in order through `Transformer.forward` with a `TrieKV`: in
   every attention layer it keeps the wave's keys/values (when a later wave reads
   them) and hands the layer the wave's context rows, gathered from earlier waves,
   followed by the wave's own keys under a mask (context: all visible; own: causal).
   The gathered keys/values stay in the autograd graph of the waves that computed
   them, so the gradient of a shared position flows back through it once, summed
   over the branches that read it.
2) Per wave, the log-softmax of every row once; then each datum's target logprob at
   each of its positions, picked from the row that computed the position.
3) Put the picked values in the chunk's (B, T) grid, zero on the padding.

The result equals the plain forward's target logprobs up to float rounding; the
losses then run on it unchanged. This module knows the model's forward signature and
the `KVView` protocol; not losses, optimizers or how the plan was made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from prefixgym.engine.model import ModelConfig, Transformer
from prefixgym.engine.prefix_trie import TriePlan, Wave

__all__ = ["TrieKV", "context_weight", "plan_logprobs"]

Tensor = torch.Tensor


def context_weight(config: ModelConfig) -> float:
    """Memory of one context row relative to one computed position, as the token budget
    counts them: a context row holds a key and a value per layer (2·Hkv·D floats); a
    computed position holds at least its two norm inputs and three MLP activations per
    layer and its logits (a lower bound, so the weight errs on the high side)."""
    per_context = config.n_layers * 2 * config.n_kv_heads * config.head_dim
    per_position = config.n_layers * (2 * config.dim + 3 * config.hidden_dim) + config.vocab_size
    return per_context / per_position


class _KVStore:
    """Keys/values of the waves that later waves read: per layer, (rows, Hkv, D) pieces."""

    def __init__(self, n_layers: int) -> None:
        self.k: list[list[Tensor]] = [[] for _ in range(n_layers)]
        self.v: list[list[Tensor]] = [[] for _ in range(n_layers)]

    def add(self, layer: int, k_N_Hkv_L_D: Tensor, v_N_Hkv_L_D: Tensor) -> None:
        N, Hkv, L, D = k_N_Hkv_L_D.shape
        self.k[layer].append(k_N_Hkv_L_D.transpose(1, 2).reshape(N * L, Hkv, D))
        self.v[layer].append(v_N_Hkv_L_D.transpose(1, 2).reshape(N * L, Hkv, D))

    def gather(self, layer: int, rows_N_A: Tensor) -> tuple[Tensor, Tensor]:
        """(N, Hkv, A, D) keys and values of the given rows."""
        ks, vs = self.k[layer], self.v[layer]
        k = ks[0] if len(ks) == 1 else torch.cat(ks)
        v = vs[0] if len(vs) == 1 else torch.cat(vs)
        return _rows(k, rows_N_A).transpose(1, 2), _rows(v, rows_N_A).transpose(1, 2)


def _rows(x_R_H_D: Tensor, rows_N_A: Tensor) -> Tensor:
    """x[rows] as (N, A, H, D), by `index_select`: a shared row is read by many
    branches, and the backward of plain indexing adds their gradients with atomics
    on CPU (in any order, so not bit-reproducible); index_select's adds in order, and
    runs faster."""
    return x_R_H_D.index_select(0, rows_N_A.reshape(-1)).reshape(*rows_N_A.shape,
                                                                   *x_R_H_D.shape[1:])


class TrieKV:
    """The `KVView` of one wave (see `layers.KVView`): context rows, then own keys."""

    def __init__(self, store: _KVStore, wave: Wave, device: torch.device) -> None:
        self.store = store
        self.stored = wave.stored
        self.context_N_A = None if wave.context_N_A is None else wave.context_N_A.to(device)
        self.mask = None if wave.mask_N_1_L_K is None else wave.mask_N_1_L_K.to(device)

    def update(
        self, layer_idx: int, k_N_Hkv_L_D: Tensor, v_N_Hkv_L_D: Tensor
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        out: tuple[Tensor, Tensor, Tensor | None]
        if self.context_N_A is None:
            out = (k_N_Hkv_L_D, v_N_Hkv_L_D, None)
        else:
            k_ctx, v_ctx = self.store.gather(layer_idx, self.context_N_A)
            out = (torch.cat((k_ctx, k_N_Hkv_L_D), dim=2),
                   torch.cat((v_ctx, v_N_Hkv_L_D), dim=2), self.mask)
        if self.stored:
            self.store.add(layer_idx, k_N_Hkv_L_D, v_N_Hkv_L_D)
        return out


def plan_logprobs(
    model: Transformer,
    plan: TriePlan,
    targets_B_T: Tensor,
    autocast: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
) -> Tensor:
    """(B, T) float32 logprobs of `targets_B_T` (the chunk's targets, on the model's
    device) at every position of the plan's datums; 0 on the padding. Steps 1-3."""
    device = targets_B_T.device
    store = _KVStore(model.config.n_layers)
    targets = targets_B_T.reshape(-1)
    picked: list[Tensor] = []
    for wave in plan.waves:
        # 1) one forward per wave
        with autocast():
            logits_N_L_V = model(wave.tokens_N_L.to(device), wave.positions_N_L.to(device),
                                 TrieKV(store, wave, device))
        # 2) normalise each row once (the fused kernel cross_entropy uses); pick every
        # (datum, position) that this wave computed
        V = logits_N_L_V.shape[-1]
        logprobs_RV = torch.log_softmax(logits_N_L_V.reshape(-1, V), -1).reshape(-1)
        # flat positions, read with index_select: datums that share a position and
        # its target pick the same element, and their gradients must add in order
        flat = wave.rows_used.to(device) * V + targets[wave.cells_used.to(device)]
        picked.append(logprobs_RV.index_select(0, flat))
    # 3) into the (B, T) grid
    picked.append(torch.zeros(1, device=device, dtype=picked[0].dtype))
    return torch.cat(picked)[plan.order_B_T.to(device)]
