"""Lockstep rounds for agent programs, whose calls arrive from other threads.

An agent program's calls reach the sampler from the gateway's server thread, whenever
the program sends them, so which calls the engine batches together -- and with them the
last bits of every logprob -- would depend on timing. `AgentRounds` holds each call until
every live rollout has either sent its next call or returned; then it submits them all as
one round, ordered by (rollout key, call number), through `sample_many` where the sampler
has it (a deterministic engine runs the round alone). A rollout that will call no more
(its program returned, failed or timed out) must `retire` exactly once. Each rollout gets
its own `SamplingClient` view (`client(key)`), which the gateway samples through.

Calls of one round with the same prompt and the same way of sampling (a GRPO group's
first calls: one task, G programs) go to the sampler as one request for all their samples,
so that one prefill serves them, as a group's first turn does for envs; the first call's
seed seeds them. Usage is counted as the engine counts a request that joins another's
prefill: the first call's prompt as the request's was (computed and cached), each other
call's whole prompt as cached; each call its own sampled tokens.

A program that sends calls in parallel counts each as a rollout's turn, so its rounds can
close before a slower rollout has sent its call: still correct, no longer reproducible.

Thread-safe; knows the sampling protocols, not HTTP, programs or envs.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import threading
from dataclasses import dataclass

from prefixgym.futures import APIFuture
from prefixgym.protocols import SamplingClient
from prefixgym.rollouts.rounds import submit_round
from prefixgym.types import ModelInput, SampleRequest, SampleResponse, SamplingParams, Usage


@dataclass
class _Held:
    key: tuple[str, int]
    request: SampleRequest
    future: APIFuture[SampleResponse]


class AgentRounds:
    """Rounds over `live` rollouts' calls (module docstring)."""

    def __init__(self, sampler: SamplingClient, live: int) -> None:
        self._sampler = sampler
        self._live = live
        self._held: list[_Held] = []
        self._calls: dict[str, itertools.count[int]] = {}
        self._lock = threading.Lock()
        self.rounds = 0

    def client(self, key: str) -> SamplingClient:
        """The sampler rollout `key`'s calls go through."""
        with self._lock:
            self._calls.setdefault(key, itertools.count())
        return _RoundClient(self, key)

    def submit(self, key: str, request: SampleRequest) -> APIFuture[SampleResponse]:
        future: APIFuture[SampleResponse] = APIFuture()
        with self._lock:
            self._held.append(_Held((key, next(self._calls[key])), request, future))
            ready = self._take_round()
        self._run(ready)
        return future

    def retire(self) -> None:
        """One live rollout will call no more."""
        with self._lock:
            self._live -= 1
            if self._live < 0:
                raise RuntimeError("more rollouts retired than were live")
            ready = self._take_round()
        self._run(ready)

    def _take_round(self) -> list[_Held]:
        if not self._held or len(self._held) < self._live:
            return []
        ready, self._held = sorted(self._held, key=lambda h: h.key), []
        self.rounds += 1
        return ready

    def _run(self, ready: list[_Held]) -> None:
        """Submit a round: calls with one prompt and one way of sampling (their seeds
        aside) go as one request for all their samples, so that they share one prefill
        -- a GRPO group's first calls, which pose one task -- seeded by the first."""
        if not ready:
            return
        merged: dict[tuple[tuple[int, ...], str], list[_Held]] = {}
        for held in ready:
            merged.setdefault(_shape(held.request), []).append(held)
        batches = list(merged.values())
        requests = [_joined(batch) for batch in batches]
        try:
            futures = submit_round(self._sampler, requests)
        except Exception as error:  # noqa: BLE001 - every call of the round gets it
            for h in ready:
                h.future.set_exception(error)
            return
        for batch, inner in zip(batches, futures):
            inner.future().add_done_callback(functools.partial(_split, batch))


def _shape(request: SampleRequest) -> tuple[tuple[int, ...], str]:
    prompt = request.prompt
    tokens = prompt.tokens if isinstance(prompt, ModelInput) else list(prompt)
    params = (request.sampling_params or SamplingParams()).model_copy(update={"seed": None})
    return tuple(tokens), params.model_dump_json()


def _joined(batch: list[_Held]) -> SampleRequest:
    first = batch[0].request
    return SampleRequest(first.prompt, sum(h.request.num_samples for h in batch),
                         first.sampling_params)


def _split(batch: list[_Held], done: concurrent.futures.Future[SampleResponse]) -> None:
    """Each call of a joined request gets its own samples and usage (module docstring)."""
    error = done.exception()
    if error is not None:
        for h in batch:
            h.future.set_exception(error)
        return
    response = done.result()
    start, whole = 0, response.usage
    prompt = whole.prefill_computed_tokens + whole.prefill_cached_tokens
    for i, held in enumerate(batch):
        n = held.request.num_samples
        sequences = response.sequences[start:start + n]
        usage = Usage(prefill_computed_tokens=whole.prefill_computed_tokens if i == 0 else 0,
                      prefill_cached_tokens=whole.prefill_cached_tokens if i == 0 else prompt,
                      sampled_tokens=sum(len(s.tokens) for s in sequences))
        held.future.set_result(response.model_copy(update={
            "sequences": sequences, "usage": usage,
            "prompt_cache_hit_tokens": usage.prefill_cached_tokens}))
        start += n


class _RoundClient:
    """One rollout's view of the rounds: `sample` joins the next round."""

    def __init__(self, rounds: AgentRounds, key: str) -> None:
        self._rounds, self._key = rounds, key

    def sample(self, prompt: ModelInput | list[int], num_samples: int = 1,
               sampling_params: SamplingParams | None = None,
               include_prompt_logprobs: bool = False) -> APIFuture[SampleResponse]:
        if include_prompt_logprobs:
            raise ValueError("a lockstep agent rollout does not ask for prompt logprobs")
        model_input = prompt if isinstance(prompt, ModelInput) else ModelInput.from_ints(prompt)
        request = SampleRequest(model_input, num_samples, sampling_params or SamplingParams())
        return self._rounds.submit(self._key, request)

    def compute_logprobs(self, prompt: ModelInput | list[int]) -> APIFuture[list[float | None]]:
        return self._rounds._sampler.compute_logprobs(prompt)
