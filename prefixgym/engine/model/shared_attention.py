"""Attention of one query per row over keys several rows share (a cascade).

`SharedKeys` is what a `KVView` hands a one-query forward besides each row's own keys
(the sampler's decode view: engine/sampler/shared_keys.py finds the segments);
`attend_shared` attends each part by SDPA's CPU flash kernel (`FLASH_CPU`, which also
returns each query's log-sum-exp) and merges them by those: the softmax over the union
of the keys, each segment's keys read once for the queries of all its rows. `layers.py`
calls it; it knows nothing of blocks, pools or requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixgym.engine.model.wide_ops import wide

__all__ = ["FLASH_CPU", "SharedKeys", "attend_shared"]


@dataclass(frozen=True)
class SharedKeys:
    """One layer's keys/values that several rows of a one-query forward all see, in S
    segments (a cascade, as FlashInfer's): each segment's keys are read once for the
    queries of its rows, not once per row.

    `k`, `v`: (S, Hkv, Tk, D), every segment's keys from 0; `mask`: additive (S, 1, 1,
    Tk), hiding the padding of segments shorter than Tk, or None; `rows_S_M`: each
    segment's M rows (a row in one segment of the S at most); `every_row`: one segment,
    whose rows are the forward's rows 0..B-1 in order (its queries and results are then
    read and written in place, not gathered and scattered)."""

    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    rows_S_M: torch.Tensor
    every_row: bool = False


FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
"""SDPA's CPU flash kernel, which also returns each row's log-sum-exp (torch's own op;
it has no gradient for that output, so training takes the plain path)."""


def attend_shared(q_B_H_1_D: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None, shared: list[SharedKeys],
                  scale: float | None) -> torch.Tensor:
    """One query per row over its own keys (`k`, `v`, `mask`) and the segments of
    `shared`: each part by SDPA's CPU flash kernel, which also returns each query's
    log-sum-exp, then merged by those (softmax over the union of the keys): a segment's
    keys are read once for the G query heads of each of its rows at once."""
    flash = FLASH_CPU
    if flash is None:
        raise RuntimeError("shared keys need SDPA's CPU flash kernel, which this torch lacks")
    B, H, _, D = q_B_H_1_D.shape
    Hkv = k.shape[1]
    G = H // Hkv
    q = q_B_H_1_D.reshape(B, Hkv, G, D)  # (GQA: a KV head's query heads as its queries)
    with wide():  # the attention on every thread, the merge's small ops as they are
        out, lse = flash(q, k, v, 0.0, False, attn_mask=mask, scale=scale)[:2]
    for part in shared:
        S, M = part.rows_S_M.shape
        rows = None if part.every_row else part.rows_S_M.flatten()
        q_rows = q if rows is None else q[rows]
        q_S = q_rows.view(S, M, Hkv, G, D).transpose(1, 2).reshape(S, Hkv, M * G, D)
        with wide():
            o_S, lse_S = flash(q_S, part.k, part.v, 0.0, False, attn_mask=part.mask,
                               scale=scale)[:2]
        o_N = o_S.view(S, Hkv, M, G, D).transpose(1, 2).reshape(S * M, Hkv, G, D)
        l_N = lse_S.view(S, Hkv, M, G).transpose(1, 2).reshape(S * M, Hkv, G)
        l_own, o_own = (lse, out) if rows is None else (lse[rows], out[rows])
        top = torch.maximum(l_own, l_N)
        w_own, w_N = (l_own - top).exp_(), (l_N - top).exp_()
        total = w_own + w_N
        merged = ((o_own * w_own.unsqueeze(-1) + o_N * w_N.unsqueeze(-1))
                  / total.unsqueeze(-1)).to(out.dtype)
        merged_lse = top + total.log()
        if rows is None:
            out, lse = merged, merged_lse
        else:
            out[rows], lse[rows] = merged, merged_lse
    return out.reshape(B, H, 1, D)
