"""The KV store of the sampler: one preallocated pool of fixed-size blocks on one device.

`KVPool` holds the keys and values of every running sequence and every cached prefix
block, as two tensors shaped (n_layers, n_kv_heads * num_blocks, block_size, head_dim):
block b of head h of a layer is row `h * num_blocks + b`. A sequence's KV is a block
table, a list of block ids, position p living at offset p % block_size of block
table[p // block_size]. Block 0 is never handed out: it pads short tables (masked).

`PagedView` is the `KVView` one forward gets: it writes the new keys/values of R rows
at their positions through their tables, then gathers each row's blocks, in table
order, into one contiguous (R, n_kv_heads, Tk, head_dim) tensor per layer -- the
layout SDPA reads fastest on CPU (docs/benchmarks.md, "Decode") -- under an additive
mask: key position <= the query's position. Indices and the mask are built once per
forward and shared by every layer.

This module knows nothing of requests, tokens, refcounts or the prefix cache: which
block is free is the cache's business (prefix_cache.py); this moves tensors.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks, self.block_size, self.n_kv_heads = num_blocks, block_size, n_kv_heads
        self.dtype, self.device = dtype, device
        # empty, not zeros: pages are touched only when used; a block is zeroed on its
        # first allocation (`zero`), so stale or padding keys are always finite
        shape = (n_layers, n_kv_heads * num_blocks, block_size, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.zero([0])

    @property
    def block_bytes(self) -> int:
        return 2 * self.k[:, : self.n_kv_heads].numel() * self.k.element_size()

    def _rows(self, blocks: list[int]) -> torch.Tensor:
        ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
        heads = torch.arange(self.n_kv_heads, device=self.device) * self.num_blocks
        return (heads.unsqueeze(1) + ids).flatten()  # (Hkv * len(blocks),)

    def zero(self, blocks: list[int]) -> None:
        rows = self._rows(blocks)
        self.k[:, rows] = 0
        self.v[:, rows] = 0

    def copy_block(self, src: int, dst: int, num_positions: int) -> None:
        """Copy positions [0, num_positions) of block `src` into block `dst`."""
        rows_src, rows_dst = self._rows([src]), self._rows([dst])
        self.k[:, rows_dst, :num_positions] = self.k[:, rows_src, :num_positions]
        self.v[:, rows_dst, :num_positions] = self.v[:, rows_src, :num_positions]

    def view(
        self, tables: list[list[int]], starts: list[int], lengths: list[int], width: int
    ) -> PagedView:
        return PagedView(self, tables, starts, lengths, width)


class PagedView:
    """R rows, right-padded to T = `width` new tokens: row r computes positions
    [starts[r], starts[r] + lengths[r]) and its keys [0, starts[r]) are already in its
    blocks `tables[r]`. Padding queries are not stored and see only finite keys."""

    def __init__(
        self, pool: KVPool, tables: list[list[int]], starts: list[int], lengths: list[int],
        width: int,
    ) -> None:
        dev, bs, N, Hkv = pool.device, pool.block_size, pool.num_blocks, pool.n_kv_heads
        T = width
        self.pool = pool
        ends = [s + n for s, n in zip(starts, lengths)]
        nb = max(-(-e // bs) for e in ends)  # blocks every row's keys fit in
        self.num_keys = nb * bs
        padded = [t[:nb] + [0] * (nb - len(t[:nb])) for t in tables]
        table_R_nb = torch.tensor(padded, dtype=torch.long, device=dev)
        heads = torch.arange(Hkv, device=dev) * N
        # gather rows: (R, Hkv, nb) -> the layer's (Hkv*N) block rows, in table order
        self.gather_rows = (heads.view(1, Hkv, 1) + table_R_nb.unsqueeze(1)).flatten()
        start_R = torch.tensor(starts, device=dev)
        query_pos_R_T = start_R.unsqueeze(1) + torch.arange(T, device=dev)
        self.positions_R_T = query_pos_R_T
        key_pos = torch.arange(self.num_keys, device=dev)
        allowed = (key_pos <= query_pos_R_T.unsqueeze(2)).unsqueeze(1)  # (R, 1, T, Tk)
        self.mask = torch.zeros(allowed.shape, dtype=pool.dtype, device=dev).masked_fill_(
            allowed.logical_not(), float("-inf")) if any(starts) else None
        # write targets: the valid (row, t) cells, as flat (head, block, offset) slots
        valid_R_T = torch.arange(T, device=dev) < torch.tensor(lengths, device=dev).unsqueeze(1)
        self.src_M = valid_R_T.flatten().nonzero().squeeze(1)  # into the flattened (R*T)
        pos_M = query_pos_R_T.flatten()[self.src_M]
        row_M = self.src_M // T
        block_M = table_R_nb[row_M, pos_M // bs]
        slot_M = block_M * bs + pos_M % bs  # within one head's (N*bs) positions
        self.slot_index = ((heads * bs).unsqueeze(1) + slot_M).flatten()  # (Hkv*M,)
        self.last_index_R = torch.tensor(lengths, device=dev) - 1
        # every row starts at 0: its keys are this forward's own, plain causal, no gather
        self.causal = not any(starts)

    def update(
        self, layer_idx: int, k_R_Hkv_T_D: torch.Tensor, v_R_Hkv_T_D: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        k_layer, v_layer = self.pool.k[layer_idx], self.pool.v[layer_idx]  # (Hkv*N, bs, D)
        R, Hkv, T, D = k_R_Hkv_T_D.shape
        for new, layer in ((k_R_Hkv_T_D, k_layer), (v_R_Hkv_T_D, v_layer)):
            new_Hkv_M_D = new.transpose(0, 1).reshape(Hkv, R * T, D)[:, self.src_M]
            layer.view(-1, D).index_copy_(0, self.slot_index,
                                          new_Hkv_M_D.reshape(-1, D).to(layer.dtype))
        if self.causal:
            return k_R_Hkv_T_D.to(self.pool.dtype), v_R_Hkv_T_D.to(self.pool.dtype), None
        Tk = self.num_keys
        k_all = k_layer.index_select(0, self.gather_rows).view(R, Hkv, Tk, D)
        v_all = v_layer.index_select(0, self.gather_rows).view(R, Hkv, Tk, D)
        return k_all, v_all, self.mask
