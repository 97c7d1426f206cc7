"""Lockstep rounds: the next request of every live episode, submitted together, in order.

Free-running rollouts send each episode's request the moment its env has answered,
so which requests the engine batches together depends on thread timing, and with it
the last bits of every logprob. In lockstep, a `Rounds` holds each request until
every live episode has either asked for its next turn or ended; then it submits them
all as one round, sorted by episode id, through `sample_many` where the sampler has
it (a deterministic engine runs the round alone). The rounds, and so the engine's
batches, are then a function of the episodes alone.

The count of live episodes is what makes a round complete: each episode that will
never ask again (it ended, or its env failed) must `retire` exactly once.

Knows the sampling protocols and asyncio; not envs, conversations or the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass

from prefixgym.futures import APIFuture
from prefixgym.protocols import RoundSamplingClient, SamplingClient
from prefixgym.types import SampleRequest, SampleResponse


@dataclass
class _Pending:
    key: str  # the first episode's id: the request's place in its round
    request: SampleRequest
    future: asyncio.Future[Awaitable[SampleResponse]]


class Rounds:
    """Collects the requests of `live` episodes into rounds; see the module docstring."""

    def __init__(self, sampler: SamplingClient, live: int) -> None:
        self._sampler = sampler
        self._live = live
        self._pending: list[_Pending] = []
        self._waiting = 0  # episodes served by the pending requests
        self.rounds = 0  # rounds submitted so far

    async def sample(self, key: str, request: SampleRequest, episodes: int) -> SampleResponse:
        """`request` on behalf of `episodes` live episodes (a shared first turn serves a
        whole group); answered once its round is complete and sampled."""
        future: asyncio.Future[Awaitable[SampleResponse]] = (
            asyncio.get_running_loop().create_future())
        self._pending.append(_Pending(key, request, future))
        self._waiting += episodes
        self._flush_if_complete()
        return await (await future)

    def retire(self, episodes: int = 1) -> None:
        """`episodes` live episodes will ask for nothing more."""
        self._live -= episodes
        if self._live < 0:
            raise RuntimeError("more episodes retired than were live")
        self._flush_if_complete()

    def _flush_if_complete(self) -> None:
        if not self._pending or self._waiting < self._live:
            return
        pending = sorted(self._pending, key=lambda p: p.key)
        self._pending, self._waiting = [], 0
        self.rounds += 1
        try:
            futures = submit_round(self._sampler, [p.request for p in pending])
        except Exception as error:  # noqa: BLE001 - every waiter of the round gets it
            for p in pending:
                p.future.set_exception(error)
            return
        for p, f in zip(pending, futures):
            p.future.set_result(f)


def submit_round(sampler: SamplingClient, requests: list[SampleRequest]
                 ) -> list[APIFuture[SampleResponse]]:
    """`requests` as one round: through `sample_many` where the sampler has it (a
    deterministic engine runs the round alone), else one `sample` each, in order."""
    if isinstance(sampler, RoundSamplingClient):
        return list(sampler.sample_many(requests))
    return [sampler.sample(r.prompt, r.num_samples, r.sampling_params) for r in requests]
