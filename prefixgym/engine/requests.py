"""One sampling request inside the engine: its state, its validation, its response.

A `Request` is what `Scheduler.submit` queues: a prompt, decoding settings, the model
of one weights version and the future to complete. Each of its `num_samples`
`Sequence`s tracks one continuation: tokens, logprobs, its block table (the KV pool's
blocks holding its positions), how many blocks it may still take, and its own random
generator. `validate_request` refuses bad input with a
ValueError naming the field; `build_response` turns a finished request into the wire
`SampleResponse` and its `Usage`.

This module knows nothing of batching, tensors or the prefix cache's keys.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from prefixgym.engine.model import Transformer
from prefixgym.futures import APIFuture
from prefixgym.types import SampledSequence, SampleResponse, SamplingParams, Usage


@dataclass(eq=False)
class Request:
    """A queued or running request; the fields after `future` are engine state."""

    prompt: list[int]
    num_samples: int
    params: SamplingParams
    include_prompt_logprobs: bool
    model: Transformer
    version: int
    seed: int
    future: APIFuture[SampleResponse] = field(default_factory=APIFuture)
    num_cached_tokens: int = 0
    tail_pin: list[int] = field(default_factory=list)  # a cached block to copy from
    prompt_logprobs: list[float | None] | None = None
    sequences: list[Sequence] = field(default_factory=list)
    unfinished: int = 0


@dataclass(eq=False)
class Sequence:
    """One of a request's samples while it decodes."""

    request: Request
    rng: random.Random
    max_tokens: int
    stop_token_ids: frozenset[int]
    stop_strings: list[str]
    stop_window: int
    kv_len: int  # positions whose KV is in its blocks; the next input sits at this position
    table: list[int] = field(default_factory=list)  # block ids, position p in table[p // bs]
    reserved: int = 0  # blocks promised to it, not yet allocated
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str | None = None

    @property
    def is_greedy(self) -> bool:
        return self.request.params.temperature == 0


def new_sequences(req: Request) -> list[Sequence]:
    """The request's `num_samples` sequences, each at the end of the prompt; sample i
    draws from its own generator, derived from the request's seed."""
    p = req.params
    window = 4 * max((len(s) for s in p.stop), default=0) + 4
    stop_ids = frozenset(p.stop_token_ids)
    return [
        Sequence(req, random.Random(f"{req.seed}/{i}"), p.max_tokens, stop_ids, list(p.stop),
                 window, kv_len=len(req.prompt))
        for i in range(req.num_samples)
    ]


def kv_positions(req: Request) -> int:
    """Positions a sample of `req` stores KV for: the prompt and every sampled token
    but the last (no step reads it)."""
    return len(req.prompt) + max(req.params.max_tokens - 1, 0)


def build_response(req: Request) -> SampleResponse:
    """The wire response of a finished request (fields built here, so not re-validated)."""
    usage = Usage(
        prefill_computed_tokens=len(req.prompt) - req.num_cached_tokens,
        prefill_cached_tokens=req.num_cached_tokens,
        sampled_tokens=sum(len(s.tokens) for s in req.sequences),
    )
    sequences = [
        SampledSequence.model_construct(
            tokens=s.tokens, logprobs=s.logprobs, stop_reason=s.stop_reason or "length"
        )
        for s in req.sequences
    ]
    return SampleResponse.model_construct(
        sequences=sequences, prompt_logprobs=req.prompt_logprobs, usage=usage
    )


def validate_request(
    prompt: list[int], model: Transformer, params: SamplingParams, num_samples: int, can_decode: bool
) -> None:
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
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    total = len(prompt) + params.max_tokens
    if total > cfg.max_seq_len:
        raise ValueError(
            f"prompt length {len(prompt)} + max_tokens {params.max_tokens} = {total} exceeds the "
            f"model's max_seq_len {cfg.max_seq_len}; shorten the prompt or lower max_tokens"
        )
    for t in params.stop_token_ids:
        if t < 0 or t >= cfg.vocab_size:
            raise ValueError(
                f"stop_token_ids holds {t}, outside the model's vocabulary [0, {cfg.vocab_size})"
            )
    if params.stop and not can_decode:
        raise ValueError("stop strings need a tokenizer to decode with; this engine has none")
