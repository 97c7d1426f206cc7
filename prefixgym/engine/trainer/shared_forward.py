"""Run a `TriePlan` through the model: each shared position once, per-datum logprobs.

1) Run the plan's waves in order through `Transformer.forward` with a `TrieKV`: in
   every attention layer it keeps the wave's keys/values (when a later wave reads
   them) and hands the layer the wave's context rows, gathered from earlier waves,
   followed by the wave's own keys under a mask (context: all visible; own: causal;
   in a layer with a sliding window, only the keys within it).
   The gathered keys/values stay in the autograd graph of the waves that computed
   them, so the gradient of a shared position flows back through it once, summed
   over the branches that read it.
2) Per wave, the log-softmax of every row once; then each datum's target logprob at
   each of its positions, picked from the row that computed the position
   (`plan_logprobs`). For the chunked head (`plan_rows`), the distinct (row, target)
   pairs the datums read are gathered from the final norm's output instead, as
   `logprob_head.HeadRows`, whose logprobs `logprob_head` computes a chunk at a time:
   a shared row is computed once per distinct target (twice at a branch point whose
   datums' next tokens differ), not once per datum.
3) Put the picked values in the chunk's (B, T) grid, zero on the padding
   (`HeadRows.to_grid` for the chunked head).

The result equals the plain forward's target logprobs up to float rounding; the
losses then run on it unchanged. This module knows the model's forward signature and
the `KVView` protocol; not losses, optimizers or how the plan was made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from prefixgym.engine.model import ModelConfig, Transformer, window_allows
from prefixgym.engine.trainer.logprob_head import HeadRows
from prefixgym.engine.trainer.prefix_trie import TriePlan, Wave

__all__ = ["TrieKV", "context_weight", "plan_logprobs", "plan_rows"]

Tensor = torch.Tensor


def context_weight(config: ModelConfig) -> float:
    """Memory of one context row relative to one computed position, as the token budget
    counts them: a context row holds a key and a value per layer (2·Hkv·D floats); a
    computed position holds at least its two norm inputs and three MLP activations per
    layer and its logits (a lower bound, so the weight errs on the high side)."""
    per_context = config.kv_elements_per_position
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

    def gather(self, layer: int, rows_N_A: Tensor, pieces: int) -> tuple[Tensor, Tensor]:
        """(N, Hkv, A, D) keys and values of the given rows of the first `pieces` pieces."""
        ks, vs = self.k[layer][:pieces], self.v[layer][:pieces]
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
    """The `KVView` of one wave (see `layers.KVView`): context rows, then own keys.

    A layer may call `update` again for the same wave (a block recomputed in backward,
    `Transformer.hidden(recompute=True)`): the second call reads the pieces the first
    one saw and stores nothing, so it returns the same keys/values."""

    def __init__(self, store: _KVStore, wave: Wave, device: torch.device,
                 windows: tuple[int, ...] = ()) -> None:
        self.store = store
        self.stored = wave.stored
        self.context_N_A = None if wave.context_N_A is None else wave.context_N_A.to(device)
        self.windows = windows
        self.positions_N_L = wave.positions_N_L.to(device)
        self.max_position = int(wave.positions_N_L.max())
        mask = None if wave.mask_N_1_L_K is None else wave.mask_N_1_L_K.to(device)
        self.masks: dict[int, Tensor | None] = {0: mask}  # by window; None: plain causal
        self._pieces_seen: dict[int, int] = {}  # layer -> store pieces at its first call

    def _mask(self, window: int) -> Tensor | None:
        """The mask of a layer with this window (0: none): context row a holds position
        a, own key l position `positions_N_L[l]`."""
        if window > self.max_position:  # it hides nothing here
            window = 0
        if window not in self.masks:
            own = self.positions_N_L  # (N, L)
            base = self.masks[0]
            if base is None or self.context_N_A is None:  # own keys only
                L = own.shape[1]
                base = torch.ones(L, L, dtype=torch.bool, device=own.device).tril()
                keys = own
            else:
                A = self.context_N_A.shape[1]
                context = torch.arange(A, device=own.device).expand(own.shape[0], A)
                keys = torch.cat((context, own), dim=1)
            within = window_allows(own, keys, window).unsqueeze(1)  # (N, 1, L, K)
            self.masks[window] = base & within
        return self.masks[window]

    def update(
        self, layer_idx: int, k_N_Hkv_L_D: Tensor, v_N_Hkv_L_D: Tensor
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        first_call = layer_idx not in self._pieces_seen
        pieces = self._pieces_seen.setdefault(layer_idx, len(self.store.k[layer_idx]))
        out: tuple[Tensor, Tensor, Tensor | None]
        mask = self._mask(self.windows[layer_idx] if self.windows else 0)
        if self.context_N_A is None:
            out = (k_N_Hkv_L_D, v_N_Hkv_L_D, mask)
        else:
            k_ctx, v_ctx = self.store.gather(layer_idx, self.context_N_A, pieces)
            out = (torch.cat((k_ctx, k_N_Hkv_L_D), dim=2),
                   torch.cat((v_ctx, v_N_Hkv_L_D), dim=2), mask)
        if self.stored and first_call:
            self.store.add(layer_idx, k_N_Hkv_L_D, v_N_Hkv_L_D)
        return out


def _distinct_pairs(
    rows_U: Tensor, targets_U: Tensor, vocab_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The distinct (row, target) pairs among U uses, as (rows_P, targets_P), and each
    use's pair (U,): a row read by G datums with one target is one head row, not G."""
    pairs_P, pair_of_use_U = torch.unique(rows_U * vocab_size + targets_U, return_inverse=True)
    return pairs_P // vocab_size, pairs_P % vocab_size, pair_of_use_U


def _wave_forwards(
    forward: Callable[..., Tensor], model: Transformer, plan: TriePlan, device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager[None]], recompute: bool,
) -> Iterator[tuple[Wave, Tensor]]:
    """Step 1: each wave with what `forward` (`model.hidden` or `model`) gives for it,
    in order, every wave attending to the keys/values of the waves it reads."""
    store = _KVStore(model.config.n_layers)
    for wave in plan.waves:
        kv = TrieKV(store, wave, device, model.config.windows)
        tokens, positions = wave.tokens_N_L.to(device), wave.positions_N_L.to(device)
        with autocast():
            yield wave, forward(tokens, positions, kv, recompute=recompute)


def plan_rows(
    model: Transformer,
    plan: TriePlan,
    targets_B_T: Tensor,
    autocast: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    recompute: bool = False,
) -> HeadRows:
    """Step 1, and step 2's rows for the chunked head without the head itself: each
    wave's distinct (row, target) pairs, the datums sharing a row mostly sharing its
    target too. The head (`logprob_head.target_logprobs` or `loss_surrogate`) then
    runs on `h_P_C`, and `HeadRows.to_grid` does step 3."""
    device = targets_B_T.device
    targets = targets_B_T.reshape(-1)
    hs: list[Tensor] = []
    pair_targets: list[Tensor] = []
    pair_of_use: list[Tensor] = []
    n_pairs = 0
    for wave, h_N_L_C in _wave_forwards(model.hidden, model, plan, device, autocast,
                                        recompute):
        rows_r, targets_r, pair_of_cell = _distinct_pairs(
            wave.rows_used.to(device), targets[wave.cells_used.to(device)],
            model.config.vocab_size)
        hs.append(h_N_L_C.reshape(-1, h_N_L_C.shape[-1]).index_select(0, rows_r))
        pair_targets.append(targets_r)
        pair_of_use.append(pair_of_cell + n_pairs)
        n_pairs += int(rows_r.numel())
    # the plan's order_B_T indexes the uses in wave order, its padding one past the last
    pair_of_use.append(torch.full((1,), n_pairs, dtype=torch.long, device=device))
    pair_B_T = torch.cat(pair_of_use)[plan.order_B_T.to(device)]
    return HeadRows(torch.cat(hs), torch.cat(pair_targets), pair_B_T)


def plan_logprobs(
    model: Transformer,
    plan: TriePlan,
    targets_B_T: Tensor,
    autocast: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    recompute: bool = False,
) -> Tensor:
    """(B, T) float32 logprobs of `targets_B_T` (the chunk's targets, on the model's
    device) at every position of the plan's datums; 0 on the padding. Steps 1-3 with
    each wave's logits whole (the plain head; `plan_rows` is the chunked head's way);
    `recompute`: checkpoint every block (`Transformer.hidden`)."""
    device = targets_B_T.device
    targets = targets_B_T.reshape(-1)
    picked: list[Tensor] = []
    for wave, logits_N_L_V in _wave_forwards(model, model, plan, device, autocast, recompute):
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
