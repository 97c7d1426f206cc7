"""One forward's work, laid out: the `Batch` the scheduler hands the runner, the
`Output` the runner hands back, and how a batch is built.

`prefill_batch(cache, requests, groups)`: a row per admitted request, computing its
uncached prompt positions into its first sample's table (new blocks taken, a cached
part-filled block copied in); its other samples, and those of the requests joined to
it, share its full prompt blocks and sample from its row. `decode_batch(...)`: a row
per running sequence, each first dropping the blocks no window reads
(`release_window`) and taking a block where its next position starts one.
`prefill_chunks(wave, max_tokens)`: a wave sorted by uncached length, split where
padding would cost more than a call.

This module knows block ids, token lists and requests; it decides nothing about which
requests run (scheduler.py) and touches no tensors (runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixgym.engine.model import Transformer
from prefixgym.engine.sampler import block_tables
from prefixgym.engine.sampler.prefix_cache import PrefixCache
from prefixgym.engine.sampler.requests import Continuation, Request
from prefixgym.types import TopkLogprobs

__all__ = ["Batch", "Output", "decode_batch", "prefill_batch", "prefill_chunks"]

_CALL_COST_TOKENS = 64  # a forward call's fixed cost, in padded positions


@dataclass(eq=False)
class Batch:
    """One forward. Prefill: `requests`, row r computing `tokens[r]` (prompt[starts[r]:])
    of request r into `tables[r]`; `seqs` are all their samples and those of the
    requests joined to them, sampled from row `source_rows`. Decode: one row per running
    sequence of `seqs`. Before the forward the runner zeroes `new_blocks` and makes
    `tail_copies`; after it, `fork_copies` ((src, dst, positions))."""

    kind: str  # "prefill" or "decode"
    model: Transformer
    version: int
    seqs: list[Continuation] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    window_tables: list[list[list[int]]] = field(default_factory=list)  # per windowed group
    starts: list[int] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    source_rows: list[int] = field(default_factory=list)
    new_blocks: list[int] = field(default_factory=list)
    tail_copies: list[tuple[int, int, int]] = field(default_factory=list)
    fork_copies: list[tuple[int, int, int]] = field(default_factory=list)
    prompt_logprobs: bool = False


@dataclass
class Output:
    """What the runner computed: one token and logprob per sequence of the batch, and
    for a prompt-scoring prefill its request's prompt logprobs and top-k."""

    tokens: list[int]
    logprobs: list[float]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[TopkLogprobs | None] | None = None


def prefill_batch(cache: PrefixCache, reqs: list[Request], groups: int) -> Batch:
    """The prefill of these admitted requests (of one version), one row each."""
    bs = cache.block_size
    batch = Batch("prefill", reqs[0].model, reqs[0].version, requests=reqs,
                  prompt_logprobs=reqs[0].include_prompt_logprobs)
    for r, req in enumerate(reqs):
        P, first = len(req.prompt), req.sequences[0]
        n_hit = len(first.table)
        for _ in range(-(-P // bs) - n_hit):
            block_tables.new_block(cache, first, batch.new_blocks)
        for src, table in zip(req.tail_pin, first.group_tables):
            batch.tail_copies.append((src, table[n_hit], req.num_cached_tokens % bs))
        batch.tables.append(first.table)
        batch.starts.append(req.num_cached_tokens)
        batch.tokens.append(req.prompt[req.num_cached_tokens :])
        samples = req.sequences if req.params.max_tokens else req.sequences[:1]
        for joined in req.joined:
            if not joined.future.done():  # (failed while it waited)
                samples = samples + joined.sequences
        for seq in samples:
            if seq is not first:  # shares the full prompt blocks, copies a partial one
                block_tables.share_prompt(cache, first, seq, P, batch.new_blocks,
                                          batch.fork_copies)
            batch.seqs.append(seq)
            batch.source_rows.append(r)
    batch.window_tables = [[req.sequences[0].window_tables[g] for req in reqs]
                           for g in range(groups - 1)]
    return batch


def decode_batch(cache: PrefixCache, seqs: list[Continuation], version: int, groups: int,
                 release_window: int) -> tuple[Batch, int]:
    """One decode step over these running sequences of `version`, and the number of
    blocks they dropped out of their windows first."""
    batch = Batch("decode", seqs[0].request.model, version, seqs)
    bs = cache.block_size
    dropped = 0
    for seq in seqs:
        if release_window:
            dropped += block_tables.drop_outside_window(cache, seq, release_window)
        if seq.kv_len == len(seq.table) * bs:  # its next position starts a block
            block_tables.new_block(cache, seq, batch.new_blocks)
        batch.tables.append(seq.table)
        batch.starts.append(seq.kv_len)
        batch.tokens.append(seq.tokens[-1:])
    batch.window_tables = [[s.window_tables[g] for s in seqs] for g in range(groups - 1)]
    return batch, dropped


def prefill_chunks(reqs: list[Request], max_tokens: int) -> list[list[Request]]:
    """Split requests sorted by (version, uncached length) into prefill batches of one
    version: a new batch starts when padding it to the newcomer's length would cost more
    than a call, or it would pass `max_tokens` padded positions."""
    chunks: list[list[Request]] = []
    current: list[Request] = []
    width = 0
    for req in reqs:
        n = len(req.prompt) - req.num_cached_tokens
        if current and (current[0].version != req.version
                        or len(current) * (n - width) > _CALL_COST_TOKENS
                        or (len(current) + 1) * n > max_tokens):
            chunks.append(current)
            current = []
        current.append(req)
        width = n
    if current:
        chunks.append(current)
    return chunks
