"""One sampling request inside the engine: its state, its validation, its response.

A `RoundItem` is what a client asks for; `new_request` validates it and builds the
`Request` that `Engine.submit_many` queues: a prompt, decoding settings, the model of
one weights version and the future to complete. Each of its `num_samples`
`Continuation`s tracks one continuation: tokens, logprobs, its block table (the KV pool's
blocks holding its positions), how many blocks it may still take, and its own random
generator. `new_request` refuses bad input with a ValueError naming the field, and a
request beyond the engine's `RequestLimits`: more samples than may run at once, or
running KV that cannot fit in the byte budget (10,000 samples once tried to allocate
42 GB); `build_response` turns a finished request into the wire `SampleResponse` and
its `Usage`.

This module knows nothing of batching, tensors or the prefix cache's keys.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from typing import NamedTuple

from prefixgym.engine.model import Transformer
from prefixgym.engine.sampler.options import DEFAULT_MAX_KV_BYTES, DEFAULT_MAX_RUNNING
from prefixgym.futures import APIFuture
from prefixgym.types import SampledSequence, SampleResponse, SamplingParams, TopkLogprobs, Usage

_REQUEST_IDS = itertools.count()


class RoundItem(NamedTuple):
    """One request of a `submit_many` round."""

    prompt: list[int]
    params: SamplingParams
    num_samples: int = 1
    include_prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the engine."""

    max_samples: int = DEFAULT_MAX_RUNNING
    """Samples of one request at most: the engine's max running sequences, so a request
    never runs past that bound (the scheduler admits a request's samples together)."""
    max_kv_bytes: int = DEFAULT_MAX_KV_BYTES
    """Bytes of running KV one request may need: samples x (prompt + max_tokens)
    positions x the KV pool's bytes per position (keys and values, every layer), as
    if no block were shared."""
    kv_element_size: int = 4
    """Bytes of one key or value element in the KV pool (`SamplerOptions.kv_cache_dtype`)."""

    def __post_init__(self) -> None:
        if self.max_samples < 1 or self.max_kv_bytes < 1:
            raise ValueError(f"request limits must be positive, got {self}")


def kv_bytes_per_position(model: Transformer, element_size: int = 4) -> int:
    """Bytes of KV one position takes in the pool: keys and values of every layer, of
    `element_size` bytes each (fp32 on CPU: kv_pool.py)."""
    return model.config.kv_elements_per_position * element_size


@dataclass(eq=False)
class Request:
    """A queued or running request; the fields after `request_id` are engine state.
    `include_prompt_logprobs` here means "score the prompt" (full logits, no cache read
    before `prompt_logprobs_last_n`): asked for by prompt logprobs or top-k."""

    prompt: list[int]
    num_samples: int
    params: SamplingParams
    include_prompt_logprobs: bool
    model: Transformer
    version: int
    seed: int
    future: APIFuture[SampleResponse] = field(default_factory=APIFuture)
    topk_k: int = 0  # topk_prompt_logprobs asked for
    prompt_logprobs_last_n: int | None = None  # score only the last n prompt tokens
    return_prompt_logprobs: bool = True  # False when only the top-k were asked for
    request_id: int = field(default_factory=lambda: next(_REQUEST_IDS))
    num_cached_tokens: int = 0
    passed_over: int = 0  # waves that admitted a later request while it waited (admission.py)
    tail_pin: list[int] = field(default_factory=list)  # a cached block to copy from
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[TopkLogprobs | None] | None = None
    sequences: list[Continuation] = field(default_factory=list)
    joined: list[Request] = field(default_factory=list)  # requests riding on its prefill


@dataclass(eq=False)
class Continuation:
    """One of a request's samples while it decodes (its stop rules are the request's)."""

    request: Request
    rng: random.Random
    table: list[int] = field(default_factory=list)  # block ids, position p in table[p // bs]
    window_tables: list[list[int]] = field(default_factory=list)  # a hybrid pool's other groups'
    dropped: int = 0  # its first blocks, released when no window saw them (0 in their table)
    reserved: int = 0  # blocks promised to it, not yet allocated
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str | None = None

    @property
    def group_tables(self) -> list[list[int]]:
        """Its table in each group of the pool's layout: `table`, then `window_tables`."""
        return [self.table, *self.window_tables]

    def blocks(self) -> list[int]:
        """Every block it references, in every group."""
        return [b for t in self.group_tables for b in t if b]

    @property
    def kv_len(self) -> int:
        """Positions whose KV is in its blocks: the prompt and every sampled token but
        the last (the next input, which sits at this position)."""
        return len(self.request.prompt) + max(len(self.tokens) - 1, 0)


def blocks_per_sample(req: Request, block_size: int) -> tuple[int, int]:
    """(blocks of the first sample's table, blocks each other sample takes beyond the
    prompt's full blocks, which it shares). A sample stores KV for the prompt and every
    sampled token but the last (no step reads it); a zero-token request's other samples
    take none."""
    first = -(-(len(req.prompt) + max(req.params.max_tokens - 1, 0)) // block_size)
    return first, 0 if req.params.max_tokens == 0 else first - len(req.prompt) // block_size


def blocks_needed(req: Request, num_cached_blocks: int, block_size: int, groups: int = 1,
                  joined: bool = False) -> int:
    """Blocks the request may still take, `groups` per block of positions; `joined`:
    every sample shares another request's prompt blocks (`Scheduler`'s joining)."""
    first, other = blocks_per_sample(req, block_size)
    if joined:
        return req.num_samples * other * groups
    return (first - num_cached_blocks + (req.num_samples - 1) * other) * groups


def new_sequences(req: Request, cached_blocks: list[int], block_size: int, groups: int = 1,
                  window_blocks: list[tuple[int, ...]] | None = None,
                  joined: bool = False) -> list[Continuation]:
    """The request's `num_samples` sequences at the end of the prompt, the first holding
    `cached_blocks` (and, with `groups` > 1, their `window_blocks`: () where no window
    reaches), each promised the blocks it may still take (`blocks_per_sample`, in every
    group); `joined`: none holds blocks yet, each will share another request's prompt
    blocks as that request's own later samples do. Sample i draws from its own
    generator, derived from the request's seed (joined or not)."""
    first, other = blocks_per_sample(req, block_size)
    seqs = [Continuation(req, random.Random(f"{req.seed}/{i}"), reserved=other * groups,
                         window_tables=[[] for _ in range(groups - 1)])
            for i in range(req.num_samples)]
    if joined:
        return seqs
    seqs[0].table = list(cached_blocks)
    seqs[0].reserved = (first - len(cached_blocks)) * groups
    for g, table in enumerate(seqs[0].window_tables):
        table.extend(w[g] if w else 0 for w in window_blocks or ())
    seqs[0].dropped = sum(1 for w in window_blocks or () if not w) if groups > 1 else 0
    return seqs


def reads_cache(req: Request) -> bool:
    """Whether it takes a cached prefix at all: not when it scores its whole prompt."""
    return not req.include_prompt_logprobs or req.prompt_logprobs_last_n is not None


def join_key(req: Request) -> tuple[int, tuple[int, ...]] | None:
    """What a request must share with another to ride on its prefill: its weights
    version and prompt. None for one that scores its prompt or samples nothing (its
    prefill row is its own)."""
    if req.include_prompt_logprobs or req.params.max_tokens == 0:
        return None
    return req.version, tuple(req.prompt)


def cache_limit(req: Request) -> int:
    """How many prompt tokens may come from the cache: all but the last (its logits are
    needed); for a request scoring its prompt, none, or those before the position whose
    logits score the first of its last `prompt_logprobs_last_n` tokens."""
    P = len(req.prompt)
    if not req.include_prompt_logprobs:
        return P - 1
    last_n = req.prompt_logprobs_last_n
    return 0 if last_n is None else P - last_n - 1


def build_response(req: Request) -> SampleResponse:
    """The wire response of a finished request (fields built here, so not re-validated)."""
    usage = Usage(
        prefill_computed_tokens=len(req.prompt) - req.num_cached_tokens,
        prefill_cached_tokens=req.num_cached_tokens,
        sampled_tokens=sum(len(s.tokens) for s in req.sequences),
    )
    sequences = [
        SampledSequence.model_construct(
            tokens=s.tokens, logprobs=s.logprobs, stop_reason=s.stop_reason or "length",
            sequence_id=f"{req.request_id}:{i}",
        )
        for i, s in enumerate(req.sequences)
    ]
    return SampleResponse.model_construct(
        sequences=sequences, usage=usage, prompt_cache_hit_tokens=req.num_cached_tokens,
        prompt_logprobs=req.prompt_logprobs if req.return_prompt_logprobs else None,
        topk_prompt_logprobs=req.topk_prompt_logprobs,
    )


def new_request(item: RoundItem, model: Transformer, version: int, can_decode: bool,
                limits: RequestLimits) -> Request:
    """`item` validated (a ValueError naming the field) as a Request of `model`."""
    prompt, params, num_samples = item.prompt, item.params, item.num_samples
    cfg = model.config
    if not prompt:
        raise ValueError("prompt has no tokens; a prompt needs at least one token id")
    lo, hi = min(prompt), max(prompt)
    if lo < 0 or hi >= cfg.vocab_size:
        bad = next(t for t in prompt if t < 0 or t >= cfg.vocab_size)
        raise ValueError(
            f"prompt token id {bad} at index {prompt.index(bad)} is outside the model's "
            f"vocabulary [0, {cfg.vocab_size})"
        )
    _require_int("num_samples", num_samples, 1, math.inf, "a positive int")
    if num_samples > limits.max_samples:
        raise ValueError(f"num_samples {num_samples} exceeds this engine's limit of "
                         f"{limits.max_samples} sequences running at once; send fewer samples "
                         "per request")
    total = len(prompt) + params.max_tokens
    if total > cfg.max_seq_len:
        raise ValueError(
            f"prompt length {len(prompt)} + max_tokens {params.max_tokens} = {total} exceeds the "
            f"model's max_seq_len {cfg.max_seq_len}; shorten the prompt or lower max_tokens"
        )
    kv_bytes = num_samples * total * kv_bytes_per_position(model, limits.kv_element_size)
    if kv_bytes > limits.max_kv_bytes:
        raise ValueError(
            f"{num_samples} samples x {total} positions need {kv_bytes / 2**20:,.0f} MiB of KV, "
            f"more than this engine's {limits.max_kv_bytes / 2**20:,.0f} MiB per request; lower "
            "num_samples or max_tokens (or raise max_kv_bytes)"
        )
    for t in params.stop_token_ids:
        if t < 0 or t >= cfg.vocab_size:
            raise ValueError(
                f"stop_token_ids holds {t}, outside the model's vocabulary [0, {cfg.vocab_size})"
            )
    if params.stop and not can_decode:
        raise ValueError("stop strings need a tokenizer to decode with; this engine has none")
    # prompt scoring, the hosted service's rules: top-k is 0 (off) or in [1, vocab];
    # last_n needs prompt logprobs or top-k and is in [1, len(prompt) - 1]
    topk, last_n, vocab = item.topk_prompt_logprobs, item.prompt_logprobs_last_n, cfg.vocab_size
    _require_int("topk_prompt_logprobs", topk, 0, vocab, f"an int in [0, {vocab}]")
    if last_n is not None and not (item.include_prompt_logprobs or topk):
        raise ValueError("prompt_logprobs_last_n needs include_prompt_logprobs=True or "
                         "topk_prompt_logprobs > 0")
    if last_n is not None:
        P = len(prompt)
        _require_int("prompt_logprobs_last_n", last_n, 1, P - 1,
                     f"an int in [1, len(prompt) - 1 = {P - 1}]")
    return Request(list(prompt), num_samples, params, item.include_prompt_logprobs or topk > 0,
                   model, version, seed=0, topk_k=topk, prompt_logprobs_last_n=last_n,
                   return_prompt_logprobs=item.include_prompt_logprobs)


def _require_int(name: str, value: object, lo: int, hi: float, span: str) -> None:
    """`value` is an int (not a bool) in [lo, hi], else a ValueError: '{name} must be {span}'."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be {span}, got {value!r}")
