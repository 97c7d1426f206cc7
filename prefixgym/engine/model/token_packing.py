"""A padded batch's real tokens: `Packing`.

The sampler's prefill right-pads its rows to the longest; a view that hands the model a
`Packing` (`layers.KVView`) gets the forward's per-token work -- embeddings, norms,
linears, MLP, residuals -- run on the real tokens only, as (1, M, C), and each attention
layer unpacks its projections to (B, T) and packs its output (`decoder.py`, `layers.py`).
Knows tensors' shapes only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Packing"]


@dataclass(frozen=True)
class Packing:
    """The real tokens of a right-padded (B, T) forward: `index_M`, their flat indices
    in B*T, ascending. A view that has one (`KVView`) gets the forward's per-token work
    (embeddings, norms, linears, MLP, residuals) run on those M tokens only, as (1, M,
    C); each attention layer unpacks its projections to (B, T) and packs its output."""

    index_M: torch.Tensor
    B: int
    T: int

    def pack(self, x_B_T_C: torch.Tensor) -> torch.Tensor:
        """(1, M, C): the real cells of (B, T, C)."""
        return x_B_T_C.reshape(self.B * self.T, -1).index_select(0, self.index_M).unsqueeze(0)

    def unpack(self, x_1_M_C: torch.Tensor) -> torch.Tensor:
        """(B, T, C): the M rows in their cells, zeros in the padding (finite keys and
        values, which no real query sees)."""
        out = x_1_M_C.new_zeros(self.B * self.T, x_1_M_C.shape[-1])
        return out.index_copy_(0, self.index_M, x_1_M_C[0]).view(self.B, self.T, -1)
