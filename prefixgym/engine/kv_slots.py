"""The KV of running sequences: one slot per sequence in a growable buffer.

`SlotKV` holds keys and values of one weights version as two tensors shaped
(n_layers, slots, n_kv_heads, length, head_dim). Running sequences live compacted in
slots 0..B-1, so one decode step attends to the view `k[layer, :B, :, :Tk]` under a
mask (key position <= the row's query position; additive, 0 or -inf, built once per
forward so SDPA does not convert a bool mask in every layer); stale values past a
row's position are masked out. `prefill_view` and `decode_view` are the `KVView`s handed to
`Transformer.forward`: they store the new keys/values and return what to attend to.

This module knows nothing of requests, sampling, tokens or the prefix cache: it moves
tensors between slots, blocks and the model.
"""

from __future__ import annotations

import torch

_LENGTH_STEP = 256


class SlotKV:
    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        dtype: torch.dtype = torch.float32,
        slots: int = 4,
        length: int = _LENGTH_STEP,
    ) -> None:
        self.max_seq_len = max_seq_len
        self._shape = (n_layers, n_kv_heads, head_dim)
        self.dtype = dtype
        length = min(length, max_seq_len)
        self.k = torch.zeros(n_layers, slots, n_kv_heads, length, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def length(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def reserve(self, num_slots: int, length: int) -> None:
        """Grow (never shrink) so that `num_slots` slots of `length` positions fit."""
        if length > self.max_seq_len:
            raise ValueError(f"length {length} exceeds max_seq_len {self.max_seq_len}")
        if num_slots <= self.num_slots and length <= self.length:
            return
        new_slots = max(num_slots, self.num_slots * 2) if num_slots > self.num_slots else self.num_slots
        new_length = self.length
        if length > self.length:
            new_length = min(self.max_seq_len, -(-max(length, 2 * self.length) // _LENGTH_STEP) * _LENGTH_STEP)
        L, H, D = self._shape
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.zeros(L, new_slots, H, new_length, D, dtype=self.dtype)
            new[:, : old.shape[1], :, : old.shape[3]] = old
            setattr(self, name, new)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy positions [0, length) of slot `src` into slot `dst`."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def write(self, slot: int, kv_L_2_H_T_D: torch.Tensor, start: int = 0) -> None:
        """Store cached KV (e.g. prefix-cache blocks concatenated along T) into a slot."""
        end = start + kv_L_2_H_T_D.shape[3]
        self.k[:, slot, :, start:end] = kv_L_2_H_T_D[:, 0]
        self.v[:, slot, :, start:end] = kv_L_2_H_T_D[:, 1]

    def read(self, slot: int, start: int, end: int) -> torch.Tensor:
        """A new (n_layers, 2, n_kv_heads, end-start, head_dim) tensor of one slot's KV."""
        return torch.stack((self.k[:, slot, :, start:end], self.v[:, slot, :, start:end]), dim=1)

    def prefill_view(self, first_slot: int, starts: list[int], lengths: list[int]) -> PrefillView:
        return PrefillView(self, first_slot, starts, lengths)

    def decode_view(self, positions_B: torch.Tensor) -> DecodeView:
        return DecodeView(self, positions_B)


class PrefillView:
    """The new tokens of R rows, right-padded to T = max(lengths): row r lives in slot
    `first_slot + r` and computes positions [starts[r], starts[r] + lengths[r]); keys
    [0, starts[r]) are already in its slot. Padding queries are neither stored nor seen
    by real queries (they attend real keys only, so they stay finite). When every row
    starts at 0 the mask is None (plain causal: padding keys follow every real query)."""

    def __init__(self, kv: SlotKV, first_slot: int, starts: list[int], lengths: list[int]) -> None:
        R, T = len(starts), max(lengths)
        self.kv = kv
        self.rows = slice(first_slot, first_slot + R)
        self.num_keys = max(s + n for s, n in zip(starts, lengths))
        query_pos_R_T = torch.tensor(starts).unsqueeze(1) + torch.arange(T)
        self.positions_R_T = query_pos_R_T.clamp(max=kv.max_seq_len - 1)
        key_pos_Tk = torch.arange(self.num_keys)
        self.mask: torch.Tensor | None = None  # plain causal: every row starts at 0
        if any(starts):
            allowed = (key_pos_Tk <= query_pos_R_T.unsqueeze(2)).unsqueeze(1)  # (R, 1, T, Tk)
            self.mask = _additive(allowed, kv.dtype)
        # rows that start and end together are stored with one slice assignment
        self.span = (starts[0], starts[0] + T) if len(set(starts)) == len(set(lengths)) == 1 else None
        self.last_index_R = None if self.span else torch.tensor(lengths) - 1
        if self.span is None:
            valid_R_T = torch.arange(T) < torch.tensor(lengths).unsqueeze(1)
            self.src_N = valid_R_T.flatten().nonzero().squeeze(1)  # into the flattened (R*T)
            self.slot_N = first_slot + self.src_N // T
            self.pos_N = query_pos_R_T.flatten()[self.src_N]

    def update(
        self, layer_idx: int, k_B_Hkv_T_D: torch.Tensor, v_B_Hkv_T_D: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        k_layer, v_layer = self.kv.k[layer_idx], self.kv.v[layer_idx]  # (S, Hkv, Tcap, D)
        if self.span is not None:
            start, end = self.span
            k_layer[self.rows, :, start:end] = k_B_Hkv_T_D
            v_layer[self.rows, :, start:end] = v_B_Hkv_T_D
        else:
            R, H, T, D = k_B_Hkv_T_D.shape
            k_N = k_B_Hkv_T_D.transpose(1, 2).reshape(R * T, H, D)[self.src_N]  # (N, Hkv, D)
            v_N = v_B_Hkv_T_D.transpose(1, 2).reshape(R * T, H, D)[self.src_N]
            k_layer[self.slot_N, :, self.pos_N] = k_N.to(k_layer.dtype)
            v_layer[self.slot_N, :, self.pos_N] = v_N.to(v_layer.dtype)
        Tk = self.num_keys
        return k_layer[self.rows, :, :Tk], v_layer[self.rows, :, :Tk], self.mask


class DecodeView:
    """One new token per row: row b (slot b) at position positions_B[b]. The mask and
    the flat write indices are built once per step and shared by every layer."""

    def __init__(self, kv: SlotKV, positions_B: torch.Tensor) -> None:
        self.kv = kv
        self.batch = B = positions_B.shape[0]
        self.positions_B = positions_B
        self.num_keys = int(positions_B.max()) + 1
        key_pos = torch.arange(self.num_keys)
        allowed = (key_pos.unsqueeze(0) <= positions_B.unsqueeze(1))[:, None, None]  # (B,1,1,Tk)
        self.mask = _additive(allowed, kv.dtype)
        # (slot b, head h, position p) of one layer's (S, Hkv, Tcap, D) buffer, flattened
        _, _, Hkv, Tcap, _ = kv.k.shape
        rows_B_Hkv = torch.arange(B).unsqueeze(1) * Hkv + torch.arange(Hkv)
        self.flat_index_N = (rows_B_Hkv * Tcap + positions_B.unsqueeze(1)).flatten()

    def update(
        self, layer_idx: int, k_B_Hkv_T_D: torch.Tensor, v_B_Hkv_T_D: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k_layer, v_layer = self.kv.k[layer_idx], self.kv.v[layer_idx]  # (S, Hkv, Tcap, D)
        B, Hkv, _, D = k_B_Hkv_T_D.shape
        new_k = k_B_Hkv_T_D.reshape(B * Hkv, D).to(k_layer.dtype)
        new_v = v_B_Hkv_T_D.reshape(B * Hkv, D).to(v_layer.dtype)
        k_layer.view(-1, D).index_copy_(0, self.flat_index_N, new_k)  # one write per step
        v_layer.view(-1, D).index_copy_(0, self.flat_index_N, new_v)
        Tk = self.num_keys
        return k_layer[:B, :, :Tk], v_layer[:B, :, :Tk], self.mask


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool attention mask as SDPA's additive one: 0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(allowed.logical_not(), float("-inf"))
