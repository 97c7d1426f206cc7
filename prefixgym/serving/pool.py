"""SamplerPool: one `SamplingClient` over several OpenAI-compatible sampling servers.

A request goes:
  1) route: to the server that served the longest earlier prompt + reply that this
     prompt extends (an episode's later turns extend its first, so they follow it and
     find their prefix cached there), else to the live server with the fewest
     sequences in flight (new groups spread by load);
  2) send it; a server that cannot be reached, answers HTTP 5xx, or answers from
     weights other than the pinned ones (it lost or missed an update) is marked down
     for the rest of the run, and the request is sent again to another live server
     -- each server tried at most once per request, so retries are bounded;
  3) record where its prompt and each returned sequence live (for step 1) and count
     it for that server: requests, cached and computed prompt tokens, failures.
A server's bad-request answer (HTTP 4xx) is the request's fault: raised, not retried.

`pinned(label)` is the pool seen by one published weights version: its requests
name the adapter when there is one and refuse answers labelled otherwise
(`SampleResponse.weights_version`; where a server's answers carry no label, as vLLM's
with full weights, the label it reports at `/weight_info`, asked once per server and
version); `weights_version` is its publish number, which
the trainer compares with its own. The pool knows servers, prompts and labels; it
knows nothing of envs, episodes or training (affinity is by token prefix alone).
"""

from __future__ import annotations

import array
import concurrent.futures
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Self

from prefixgym.futures import APIFuture
from prefixgym.serving.openai_client import OpenAISamplingClient
from prefixgym.types import ModelInput, SampleResponse, SamplingParams, Usage

MAX_AFFINITY_ENTRIES = 200_000


class StaleWeightsError(RuntimeError):
    """A server answered from weights other than the ones the request was pinned to."""


class AllSamplersFailed(ConnectionError):
    """No live server could answer a request."""


@dataclass
class SamplerStats:
    """What one server did in this run."""

    url: str
    up: bool = True
    requests: int = 0
    in_flight: int = 0
    usage: Usage = field(default_factory=Usage)
    failure: str = ""


class _Affinity:
    """Which server holds a token prefix: exact prefixes of recorded sequences, LRU-bounded."""

    def __init__(self, capacity: int = MAX_AFFINITY_ENTRIES) -> None:
        self._where: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._lengths: Counter[int] = Counter()
        self._capacity = capacity

    @staticmethod
    def _key(buf: bytes, length: int) -> tuple[int, int]:
        return length, hash(buf[: 4 * length])

    def record(self, tokens: Sequence[int], server: int) -> None:
        key = self._key(array.array("i", tokens).tobytes(), len(tokens))
        if key not in self._where:
            self._lengths[len(tokens)] += 1
        self._where[key] = server
        self._where.move_to_end(key)
        while len(self._where) > self._capacity:
            (length, _), _ = self._where.popitem(last=False)
            self._lengths[length] -= 1
            if not self._lengths[length]:
                del self._lengths[length]

    def lookup(self, tokens: Sequence[int]) -> int | None:
        """The server of the longest recorded sequence that `tokens` starts with."""
        buf = array.array("i", tokens).tobytes()
        for length in sorted((n for n in self._lengths if n <= len(tokens)), reverse=True):
            server = self._where.get(self._key(buf, length))
            if server is not None:
                return server
        return None


class SamplerPool:
    """Several servers as one sampling client; see the module docstring."""

    def __init__(self, clients: Sequence[OpenAISamplingClient], max_concurrency: int = 64,
                 sticky: bool = True) -> None:
        """`sticky=False` sends every request to the least loaded server (the baseline
        that `bench/bench_sampler_pool.py` measures stickiness against)."""
        if not clients:
            raise ValueError("a SamplerPool needs at least one sampling server")
        self.clients = list(clients)
        self.stats = [SamplerStats(c.base_url) for c in self.clients]
        self.retries = 0
        self.sticky = sticky
        self._affinity = _Affinity()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_concurrency, thread_name_prefix="prefixgym-pool")

    # -- the SamplingClient interface (unpinned: any weights) ------------------------

    def sample(self, prompt: ModelInput | list[int], num_samples: int = 1,
               sampling_params: SamplingParams | None = None,
               include_prompt_logprobs: bool = False) -> APIFuture[SampleResponse]:
        return self.pinned(None).sample(prompt, num_samples, sampling_params,
                                        include_prompt_logprobs)

    def compute_logprobs(self, prompt: ModelInput | list[int]) -> APIFuture[list[float | None]]:
        return self.pinned(None).compute_logprobs(prompt)

    def pinned(self, label: str | None, weights_version: int | None = None,
               model: str | None = None) -> PinnedSampler:
        """The pool seen by the weights labelled `label` (None: whatever a server has)."""
        return PinnedSampler(self, label, weights_version, model)

    # -- servers ---------------------------------------------------------------------

    def live(self) -> list[int]:
        with self._lock:
            return [i for i, s in enumerate(self.stats) if s.up]

    def mark_down(self, server: int, error: BaseException) -> None:
        with self._lock:
            stats = self.stats[server]
            if stats.up:
                stats.up = False
                stats.failure = f"{type(error).__name__}: {error}"

    def metrics(self) -> dict[str, float]:
        """Per server (by position): requests, prefix-cache hit rate, whether it is up;
        and the pool's failed servers and retried requests. Cumulative over the run."""
        with self._lock:
            out: dict[str, float] = {"sampler/failed": float(sum(not s.up for s in self.stats)),
                                     "sampler/retries": float(self.retries)}
            for i, s in enumerate(self.stats):
                out[f"sampler/{i}/requests"] = float(s.requests)
                out[f"sampler/{i}/hit_rate"] = s.usage.cache_hit_rate
                out[f"sampler/{i}/up"] = float(s.up)
            return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for c in self.clients:
            c.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one request -----------------------------------------------------------------

    def _route(self, ids: list[int], n: int, tried: set[int]) -> int:
        """1) Where a request goes: its prefix's server, else the least loaded; its `n`
        sequences count as in flight there from now (so concurrent routes see them)."""
        with self._lock:
            server = self._choose(ids, tried)
            self.stats[server].in_flight += n
            return server

    def _choose(self, ids: list[int], tried: set[int]) -> int:
        """Called with the lock held."""
        live = [i for i, s in enumerate(self.stats) if s.up and i not in tried]
        if not live:
            failures = "; ".join(f"{s.url}: {s.failure or 'tried'}" for s in self.stats)
            raise AllSamplersFailed(f"no sampling server could answer ({failures})")
        home = self._affinity.lookup(ids) if self.sticky else None
        if home in live:
            return home
        return min(live, key=lambda i: (self.stats[i].in_flight, self.stats[i].requests, i))

    def _send(self, ids: list[int], n: int,
              request: Callable[[OpenAISamplingClient], SampleResponse]) -> SampleResponse:
        """2)-3) Send, failing over to other servers; record where the prefix lives."""
        tried: set[int] = set()
        while True:
            server = self._route(ids, n, tried)
            tried.add(server)
            try:
                response = request(self.clients[server])
            except (ConnectionError, RuntimeError) as e:  # unreachable, 5xx, stale weights
                self.mark_down(server, e)
                with self._lock:
                    self.retries += 1
                continue
            finally:
                with self._lock:
                    self.stats[server].in_flight -= n
            with self._lock:
                stats = self.stats[server]
                stats.requests += 1
                stats.usage = stats.usage + response.usage
                self._affinity.record(ids, server)
                for seq in response.sequences:
                    self._affinity.record(ids + seq.tokens, server)
            return response


class PinnedSampler:
    """The pool as a `SamplingClient` for one published weights version."""

    def __init__(self, pool: SamplerPool, label: str | None, weights_version: int | None,
                 model: str | None) -> None:
        self.pool = pool
        self.label = label
        self.weights_version = weights_version
        self.model = model
        self._version_from: Literal["metadata", "model"] = "model" if model else "metadata"
        self._confirmed: set[str] = set()  # servers whose /weight_info said `label`
        self._lock = threading.Lock()

    def sample(self, prompt: ModelInput | list[int], num_samples: int = 1,
               sampling_params: SamplingParams | None = None,
               include_prompt_logprobs: bool = False) -> APIFuture[SampleResponse]:
        ids = _ids(prompt)
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
        params = sampling_params if sampling_params is not None else SamplingParams()

        def send(client: OpenAISamplingClient) -> SampleResponse:
            response = client.sample_now(ids, num_samples, params, include_prompt_logprobs,
                                         self.model, self._version_from)
            self._check(client, response.weights_version)
            return response

        return APIFuture(self.pool._pool.submit(self.pool._send, ids, num_samples,
                                                send))

    def compute_logprobs(self, prompt: ModelInput | list[int]) -> APIFuture[list[float | None]]:
        ids = _ids(prompt)
        out: dict[str, list[float | None]] = {}

        def send(client: OpenAISamplingClient) -> SampleResponse:
            values, version = client.prompt_logprobs_now(ids, self.model)
            self._check(client, version)
            out["values"] = values
            return SampleResponse(sequences=[], weights_version=version)

        def run() -> list[float | None]:
            self.pool._send(ids, 1, send)
            return out["values"]

        return APIFuture(self.pool._pool.submit(run))

    def _check(self, client: OpenAISamplingClient, version: str | None) -> None:
        if self.label is None:
            return
        if version is None and self.model is None:  # full weights, unlabelled answers (vLLM)
            version = self._served_version(client)
        if version != self.label:
            raise StaleWeightsError(
                f"{client.base_url} answered from weights {version!r}, not the published "
                f"{self.label!r} (did it restart, or miss the update?)")

    def _served_version(self, client: OpenAISamplingClient) -> str | None:
        """The server's own label for its weights (`/weight_info`), asked once per
        server for this version: later answers of that server are taken as its."""
        with self._lock:
            if client.root_url in self._confirmed:
                return self.label
        version = client.served_weights_version()
        if version == self.label:
            with self._lock:
                self._confirmed.add(client.root_url)
        return version


def _ids(prompt: ModelInput | list[int]) -> list[int]:
    if isinstance(prompt, ModelInput):
        return prompt.to_ints()
    if isinstance(prompt, (list, tuple)):
        return ModelInput.from_ints(list(prompt)).to_ints()
    raise ValueError(f"prompt must be a ModelInput or a list of token ids, got "
                     f"{type(prompt).__name__}")
