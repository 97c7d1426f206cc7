"""The KV store of the sampler: one preallocated pool of fixed-size blocks on one device.

`KVPool` holds the keys and values of every running sequence and every cached prefix
block, as two tensors shaped (slots, n_kv_heads * num_blocks, block_size, head_dim):
block b of head h of a slot is row `h * num_blocks + b`. A sequence's KV is a block
table, a list of block ids, position p living at offset p % block_size of block
table[p // block_size]. Block 0 is never handed out: it pads short tables (masked).

Which slot holds which layer is the pool's `PageLayout`. Most models have one group of
layers: a block's slots are every layer, one table per sequence. A hybrid model (some
layers see every key, at least as many see a sliding window: Gemma 2/3, OLMo 3, gpt-oss)
has one group of full-attention layers and `groups - 1` groups of windowed ones, as many
layers each (the last padded), so that a block of positions takes one block per group
and a sequence has one table per group. A windowed group's blocks that no window reads
any more can then be freed while the full layers keep theirs (scheduler.py): the anchor
is vLLM's hybrid KV cache manager, whose groups share one pool of equal pages.

`PagedView` is the `KVView` one forward gets: it writes the new keys/values of R rows
at their positions through their tables, then gathers each row's blocks, in table
order, into one contiguous (R, n_kv_heads, Tk, head_dim) tensor per layer -- the
layout SDPA reads fastest on CPU (docs/benchmarks.md, "Decode") -- under an additive
mask: key position <= the query's position, and, in a layer with a sliding window,
key position > the query's position minus the window (`layers.window_allows`).
Indices are built once per forward and shared by every layer; each distinct window's
mask once, on its first layer.

The pool stores keys and values in `dtype` and hands attention `attend_dtype`: a bf16
model's pool on CPU stores bf16 (its keys and values are bf16 values, so nothing is
rounded, and a GiB holds twice the positions of fp32) and attention reads fp32, which
SDPA runs fastest on CPU: a prefill's gathered keys are converted once per layer, a
decode workspace once when gathered.

This module knows nothing of requests, tokens, refcounts or the prefix cache: which
block is free is the cache's business (prefix_cache.py); this moves tensors.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from prefixgym.engine.model import Packing, SharedKeys, window_allows


class SharedLayers(Protocol):
    """Keys a decode batch's rows share, per layer (shared_keys.py's `SharedSegments`)."""

    def layer(self, layer_idx: int) -> list[SharedKeys]: ...


@dataclass(frozen=True)
class PageLayout:
    """Where each layer's KV lives: `layer_slot[l]` = (group, slot) -- the layer reads
    the group's table and, in those blocks, its slot."""

    slots: int  # layers per block
    groups: int  # blocks per block of positions: one table per group
    layer_slot: tuple[tuple[int, int], ...]
    window: int  # keys the windowed groups' layers see at most (0: no windowed group)

    @staticmethod
    def of(windows: tuple[int, ...]) -> PageLayout:
        """One group of every layer, unless some layers see every key and at least as
        many see a window: then the full ones are group 0 and the windowed ones follow,
        as many per group."""
        full = [i for i, w in enumerate(windows) if not w]
        windowed = [i for i, w in enumerate(windows) if w]
        if not full or len(windowed) < len(full):
            return PageLayout(len(windows), 1, tuple((0, i) for i in range(len(windows))), 0)
        G = len(full)
        where = {layer: (0, j) for j, layer in enumerate(full)}
        where.update({layer: (1 + j // G, j % G) for j, layer in enumerate(windowed)})
        return PageLayout(G, 1 + -(-len(windowed) // G),
                          tuple(where[i] for i in range(len(windows))), max(windows))


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
        windows: tuple[int, ...] = (),
        attend_dtype: torch.dtype | None = None,
    ) -> None:
        self.num_blocks, self.block_size, self.n_kv_heads = num_blocks, block_size, n_kv_heads
        self.windows = windows or (0,) * n_layers
        """Per layer, its sliding window in keys (`ModelConfig.windows`; 0: none)."""
        self.layout = PageLayout.of(self.windows)
        self.dtype, self.device = dtype, device
        self.attend_dtype = attend_dtype or dtype
        """What the views hand attention (and what a decode workspace holds): the stored
        values converted, exactly when `dtype` is the narrower one."""
        # empty, not zeros: pages are touched only when used; a block is zeroed on its
        # first allocation (`zero`), so stale or padding keys are always finite
        shape = (self.layout.slots, n_kv_heads * num_blocks, block_size, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.zero([0])

    def zero(self, blocks: list[int]) -> None:
        rows = block_rows(self, torch.tensor([blocks], device=self.device))
        self.k[:, rows] = 0
        self.v[:, rows] = 0

    def copy_block(self, src: int, dst: int, num_positions: int) -> None:
        """Copy positions [0, num_positions) of block `src` into block `dst`."""
        src_dst = torch.tensor([[src], [dst]], device=self.device)
        rows_src, rows_dst = block_rows(self, src_dst).view(2, -1)  # (Hkv,) each
        self.k[:, rows_dst, :num_positions] = self.k[:, rows_src, :num_positions]
        self.v[:, rows_dst, :num_positions] = self.v[:, rows_src, :num_positions]

    def view(
        self, tables: list[list[int]], starts: list[int], lengths: list[int], width: int,
        window_tables: Sequence[list[list[int]]] = (),
    ) -> PagedView:
        return PagedView(self, tables, starts, lengths, width, window_tables)

    def group_tables(self, tables: list[list[int]],
                     window_tables: Sequence[list[list[int]]]) -> list[list[list[int]]]:
        """Per group, per row, its table: `tables` is group 0's, `window_tables` the
        windowed groups' (a hybrid layout's), each row's tables equally long."""
        if len(window_tables) != self.layout.groups - 1:
            raise ValueError(f"this pool has {self.layout.groups} groups of layers, got "
                             f"tables for {1 + len(window_tables)}")
        return [tables, *window_tables]


class PagedView:
    """R rows, right-padded to T = `width` new tokens: row r computes positions
    [starts[r], starts[r] + lengths[r]) and its keys [0, starts[r]) are already in its
    blocks `tables[r]` (and, in a hybrid layout, `window_tables[g][r]`: 0 where its
    window dropped a block). Padding queries are not stored and see only finite keys."""

    def __init__(
        self, pool: KVPool, tables: list[list[int]], starts: list[int], lengths: list[int],
        width: int, window_tables: Sequence[list[list[int]]] = (),
    ) -> None:
        dev, bs, N, Hkv = pool.device, pool.block_size, pool.num_blocks, pool.n_kv_heads
        T = width
        self.pool = pool
        # every row starts at 0: its keys are this forward's own, plain causal, no gather
        self.causal = not any(starts)
        nb = max(-(-(s + n) // bs) for s, n in zip(starts, lengths))  # blocks every row's keys fit in
        self.num_keys = nb * bs
        tables_R_nb = [table_tensor(pool, t, nb) for t in pool.group_tables(tables, window_tables)]
        self.gather_rows = [block_rows(pool, t) for t in tables_R_nb]  # per group
        query_pos_R_T = torch.tensor(starts, device=dev).unsqueeze(1) + torch.arange(T, device=dev)
        self.positions_R_T = query_pos_R_T
        self.max_position = max(s + n for s, n in zip(starts, lengths)) - 1
        self.masks: dict[int, torch.Tensor | None] = {0: None}  # by window; None: causal
        if not self.causal:
            key_pos = torch.arange(self.num_keys, device=dev)
            self._allowed = key_pos <= query_pos_R_T.unsqueeze(2)  # (R, T, Tk)
            self.masks[0] = _additive(self._allowed.unsqueeze(1), pool.attend_dtype)
        # write targets: the valid (row, t) cells, as flat (head, block, offset) slots
        valid_R_T = torch.arange(T, device=dev) < torch.tensor(lengths, device=dev).unsqueeze(1)
        self.src_M = valid_R_T.flatten().nonzero().squeeze(1)  # into the flattened (R*T)
        # the model's per-token layers skip the padding (model/token_packing.py)
        self.packing = (Packing(self.src_M, len(lengths), T) if len(self.src_M) < len(lengths) * T
                        else None)
        pos_M = query_pos_R_T.flatten()[self.src_M]
        row_M = self.src_M // T
        heads_bs = torch.arange(Hkv, device=dev) * (N * bs)
        self.slot_index = []  # per group: (Hkv*M,) flat (head, block, offset) slots
        for table_R_nb in tables_R_nb:
            block_M = table_R_nb[row_M, pos_M // bs]
            slot_M = block_M * bs + pos_M % bs  # within one head's (N*bs) positions
            self.slot_index.append((heads_bs.unsqueeze(1) + slot_M).flatten())
        self.last_index_R = torch.tensor(lengths, device=dev) - 1

    def update(
        self, layer_idx: int, k_R_Hkv_T_D: torch.Tensor, v_R_Hkv_T_D: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        group, slot = self.pool.layout.layer_slot[layer_idx]
        k_layer, v_layer = self.pool.k[slot], self.pool.v[slot]  # (Hkv*N, bs, D)
        R, Hkv, T, D = k_R_Hkv_T_D.shape
        for new, layer in ((k_R_Hkv_T_D, k_layer), (v_R_Hkv_T_D, v_layer)):
            new_Hkv_M_D = new.transpose(0, 1).reshape(Hkv, R * T, D)[:, self.src_M]
            layer.view(-1, D).index_copy_(0, self.slot_index[group],
                                          new_Hkv_M_D.reshape(-1, D).to(layer.dtype))
        mask = self._mask(self.pool.windows[layer_idx], T)
        attend = self.pool.attend_dtype
        if self.causal:
            return k_R_Hkv_T_D.to(attend), v_R_Hkv_T_D.to(attend), mask
        Tk = self.num_keys
        k_all = k_layer.index_select(0, self.gather_rows[group]).view(R, Hkv, Tk, D)
        v_all = v_layer.index_select(0, self.gather_rows[group]).view(R, Hkv, Tk, D)
        return k_all.to(attend), v_all.to(attend), mask

    def _mask(self, window: int, T: int) -> torch.Tensor | None:
        """The mask of a layer with this window (0: none), made on first use."""
        if window > self.max_position:  # it hides nothing here
            window = 0
        if window not in self.masks:
            if self.causal:  # own keys only, every row at positions 0..T-1
                pos = torch.arange(T, device=self.pool.device)
                allowed = ((pos <= pos.unsqueeze(1)) & window_allows(pos, pos, window))[None]
            else:
                keys = torch.arange(self.num_keys, device=self.pool.device)
                allowed = self._allowed & window_allows(self.positions_R_T, keys, window)
            # 4-D: SDPA's CPU kernel takes a 3-D mask by its slow path (4.5x, measured)
            self.masks[window] = _additive(allowed.unsqueeze(1), self.pool.attend_dtype)
        return self.masks[window]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        allowed.logical_not(), float("-inf"))


def gather_layers(pool: KVPool, gather: list[torch.Tensor], k: torch.Tensor,
                  v: torch.Tensor) -> None:
    """Every layer's blocks at the rows `gather[group]` of its group (`block_rows`) into
    `k[layer]` and `v[layer]`, contiguous, in their dtype (a bf16/fp16 pool read in
    fp32 is converted as gathered)."""
    bs, D = pool.block_size, pool.k.shape[-1]
    for layer, (group, slot) in enumerate(pool.layout.layer_slot):
        for stored, out in ((pool.k[slot], k[layer]), (pool.v[slot], v[layer])):
            if stored.dtype == out.dtype:
                torch.index_select(stored, 0, gather[group], out=out.view(-1, bs, D))
            else:
                out.view(-1, bs, D).copy_(stored.index_select(0, gather[group]))


def table_tensor(pool: KVPool, tables: list[list[int]], nb: int) -> torch.Tensor:
    """(R, nb) block ids: each table cut or padded (with block 0) to `nb` blocks."""
    padded = [t[:nb] + [0] * (nb - len(t[:nb])) for t in tables]
    return torch.tensor(padded, dtype=torch.long, device=pool.device)


def block_rows(pool: KVPool, table_R_nb: torch.Tensor) -> torch.Tensor:
    """The rows of a layer's (Hkv*N, bs, D) holding each table's blocks, flattened from
    (R, Hkv, nb): in table order (padding block 0 is always zero, and masked)."""
    heads = torch.arange(pool.n_kv_heads, device=pool.device) * pool.num_blocks
    return (heads.view(1, -1, 1) + table_R_nb.unsqueeze(1)).flatten()


_GROWTH = 64  # positions of headroom a decode workspace is gathered with


class DecodeWorkspace:
    """The keys/values of one decode batch's rows, gathered from the pool into one
    contiguous (n_layers, B, n_kv_heads, capacity, head_dim) pair in the pool's
    `attend_dtype`, so that a decode step reads them in place instead of gathering
    every step. It is derived state: the pool stays the store (every step writes both),
    and `fits` says when the batch's rows (the same sequence objects, in order) or their
    lengths have outgrown it; the next one is gathered into its storage where that is
    large enough (`reuse`).

    With `shared` (shared_keys.py: keys several rows share, kept apart), row r holds
    its own positions only, from `offsets[r]` on, at index 0; `num_positions` is then
    the most own positions a row needs. Not for a pool with windowed layers."""

    def __init__(self, pool: KVPool, rows: list[object], tables: list[list[int]],
                 num_positions: int, window_tables: Sequence[list[list[int]]] = (),
                 reuse: DecodeWorkspace | None = None, offsets: list[int] | None = None,
                 shared: SharedLayers | None = None) -> None:
        bs, Hkv = pool.block_size, pool.n_kv_heads
        self.rows = [weakref.ref(r) for r in rows]  # not kept alive (nor their models)
        self.offsets = offsets or [0] * len(rows)
        self.shared = shared
        if any(self.offsets) and any(pool.windows):
            raise ValueError("a workspace of rows' own keys needs a pool without windows")
        self.capacity = self.capacity_for(pool, num_positions)
        nb = self.capacity // bs
        own = [t[o // bs:] for t, o in zip(tables, self.offsets)]
        gather = [block_rows(pool, table_tensor(pool, t, nb))
                  for t in pool.group_tables(own, window_tables)]
        L, D = len(pool.windows), pool.k.shape[-1]
        shape = (L, len(rows), Hkv, self.capacity, D)
        size = self.elements(pool, len(rows), num_positions)
        # a replaced workspace's storage where it fits: a new one of a GiB is a fresh
        # mapping whose every page faults at first touch (at 92M, 128 rows of ~400
        # positions: ~0.9 s a turn, against ~0.2 s for the gather itself); a new one
        # has room for the next turns' longer rows
        room = size + size // 2
        self.storage: tuple[torch.Tensor, torch.Tensor] = (
            reuse.storage if reuse is not None and reuse.fits_elements(size)
            else (pool.k.new_empty(room, dtype=pool.attend_dtype),
                  pool.v.new_empty(room, dtype=pool.attend_dtype)))
        """Flat k and v buffers; `k` and `v` view their first elements, all of which the
        gather below writes."""
        self.k = self.storage[0][:size].view(shape)
        self.v = self.storage[1][:size].view(shape)
        gather_layers(pool, gather, self.k, self.v)

    @staticmethod
    def capacity_for(pool: KVPool, num_positions: int) -> int:
        """Positions per row of a workspace gathered for `num_positions`."""
        return -(-(num_positions + _GROWTH) // pool.block_size) * pool.block_size

    @classmethod
    def elements(cls, pool: KVPool, num_rows: int, num_positions: int) -> int:
        """Elements of each of k and v in a workspace of `num_rows` rows."""
        return (len(pool.windows) * num_rows * pool.n_kv_heads
                * cls.capacity_for(pool, num_positions) * pool.k.shape[-1])

    def fits_elements(self, size: int) -> bool:
        """Whether this workspace's storage should hold a workspace of `size` elements:
        it is large enough, and not over twice that (a small batch after a large one
        lets the large storage go)."""
        return size <= self.storage[0].numel() <= 2 * size

    def fits(self, rows: list[object], positions: list[int]) -> bool:
        """Whether these rows are this workspace's and it has room for `positions`."""
        return (len(rows) == len(self.rows) and all(a is b() for a, b in zip(rows, self.rows))
                and max(p - o for p, o in zip(positions, self.offsets)) < self.capacity)


class DecodeView:
    """One new token per row at `positions[b]`: stored in the pool through the row's
    table and in the workspace; attention reads the workspace in place (and the keys
    its rows share, `shared`, where it keeps them apart)."""

    def __init__(self, pool: KVPool, ws: DecodeWorkspace, tables: list[list[int]],
                 positions: list[int], window_tables: Sequence[list[list[int]]] = ()) -> None:
        dev, bs, N, Hkv = pool.device, pool.block_size, pool.num_blocks, pool.n_kv_heads
        self.pool, self.ws = pool, ws
        B = len(positions)
        own = [p - o for p, o in zip(positions, ws.offsets)]  # where in the workspace row
        self.num_keys = max(own) + 1
        pos_B, own_B = torch.tensor(positions, device=dev), torch.tensor(own, device=dev)
        self.positions_R_T = pos_B.unsqueeze(1)
        self.last_index_R = None
        # rows at one position see every key: no mask (the same result, bit for bit,
        # as an all-zero one, and a cheaper attention step)
        self.masks: dict[int, torch.Tensor | None] = {0: None}  # by window
        self._pos_B = pos_B  # (windows: only in a workspace without offsets, own == pos)
        if min(own) != max(own):
            allowed = torch.arange(self.num_keys, device=dev) <= own_B.unsqueeze(1)
            self.masks[0] = _additive(allowed[:, None, None], pool.attend_dtype)
        heads = torch.arange(Hkv, device=dev)
        self.pool_index = []  # per group: (B*Hkv) flat slots of the new positions
        for group in pool.group_tables(tables, window_tables):
            blocks = torch.tensor([t[p // bs] for t, p in zip(group, positions)], device=dev)
            slot_B = blocks * bs + pos_B % bs
            self.pool_index.append((heads.unsqueeze(0) * (N * bs) + slot_B.unsqueeze(1)).flatten())
        rows_B_Hkv = torch.arange(B, device=dev).unsqueeze(1) * Hkv + heads
        self.ws_index = (rows_B_Hkv * ws.capacity + own_B.unsqueeze(1)).flatten()

    def update(
        self, layer_idx: int, k_B_Hkv_1_D: torch.Tensor, v_B_Hkv_1_D: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        B, Hkv, _, D = k_B_Hkv_1_D.shape
        group, slot = self.pool.layout.layer_slot[layer_idx]
        ws_k, ws_v = self.ws.k[layer_idx], self.ws.v[layer_idx]  # (B, Hkv, capacity, D)
        for new, pool_layer, ws_layer in ((k_B_Hkv_1_D, self.pool.k[slot], ws_k),
                                          (v_B_Hkv_1_D, self.pool.v[slot], ws_v)):
            new_N_D = new.reshape(B * Hkv, D)
            pool_layer.view(-1, D).index_copy_(0, self.pool_index[group],
                                               new_N_D.to(pool_layer.dtype))
            ws_layer.view(-1, D).index_copy_(0, self.ws_index, new_N_D.to(ws_layer.dtype))
        Tk = self.num_keys
        return ws_k[:, :, :Tk], ws_v[:, :, :Tk], self._mask(self.pool.windows[layer_idx])

    def shared(self, layer_idx: int) -> list[SharedKeys]:
        """The keys this layer's rows share (`shared_attention.SharedKeys`), beyond `update`'s."""
        return self.ws.shared.layer(layer_idx) if self.ws.shared is not None else []

    def _mask(self, window: int) -> torch.Tensor | None:
        """The mask of a layer with this window (0: none), made on first use."""
        if window > self.num_keys - 1:  # it hides nothing here
            window = 0
        if window not in self.masks:
            keys = torch.arange(self.num_keys, device=self.pool.device)
            pos_B = self._pos_B
            allowed = (keys <= pos_B.unsqueeze(1)) & window_allows(pos_B.unsqueeze(1), keys,
                                                                    window)[:, 0]
            self.masks[window] = _additive(allowed[:, None, None], self.pool.attend_dtype)
        return self.masks[window]
