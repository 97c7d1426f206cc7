"""The sampling engine: a queue in, one background thread, `step()` until idle.

Callers (any thread, or asyncio through `await future`) `submit` a request, or
`submit_many` several at once, and get `APIFuture[SampleResponse]`s. The engine
thread loops: collect what was queued (blocking only when there is no work), then

    batch = scheduler.schedule()        # prefill or decode; blocks from the cache
    output = runner.run(batch)          # positions, block tables, forward, sampling
    scheduler.postprocess(batch, output)  # stops, retirement, cache insertion, futures

Errors travel: a bad request is refused at `submit` with a ValueError (as is one
beyond the engine's `RequestLimits`, or one the KV pool could never hold); an
exception in scheduling, `run` or postprocessing fails the requests it concerns (the
batch's, or the one being admitted) with it; the thread keeps serving the others.

Determinism: requests are admitted in an order that depends only on the queue and the
cache (cached-first, then arrival: admission.py), batches are formed from the
queue's contents at each step, and every sample draws from its own seeded generator,
so the same submissions reaching an idle engine together give the same batches and
the same outputs. `submit_many` queues its requests as one *round*: they always enter
the same step, whatever other threads do. A request's logprobs still depend, in their
last bits, on which other rows share its forwards (a matmul of a few rows takes other
kernels than one of many); with `options.deterministic` the engine takes the next round
only once the previous one has finished, so every batch is a function of one round's
requests, in their order, and the cache's contents: a caller that submits each step
of its work as one round in a fixed order (`rollouts` in lockstep) gets the same bits
every run (docs/architecture.md, "Determinism").

The engine knows nothing of chat formats or training: token ids, a `decode(ids) ->
str` for stop strings, and a model per weights version.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable, Sequence

import torch

from prefixgym.engine.model import ModelConfig, Transformer
from prefixgym.engine.sampler.kv_pool import KVPool, PageLayout
from prefixgym.engine.sampler.options import SamplerOptions
from prefixgym.engine.sampler.prefix_cache import PrefixCache
from prefixgym.engine.sampler.requests import (
    Request,
    RequestLimits,
    RoundItem,
    blocks_needed,
    new_request,
)
from prefixgym.engine.sampler.runner import ModelRunner
from prefixgym.engine.sampler.scheduler import Scheduler
from prefixgym.engine.sampler.threads import ThreadTuner
from prefixgym.engine.usage import UsageLedger
from prefixgym.futures import APIFuture
from prefixgym.types import SampleResponse, SamplingParams


def _pool_and_cache(config: ModelConfig, options: SamplerOptions, device: torch.device,
                    model_dtype: torch.dtype) -> tuple[KVPool, PrefixCache]:
    """The KV pool of `options.cache_bytes` and the prefix cache over its blocks."""
    # stored in the model's dtype (its keys and values are values of it: exact), read
    # by attention in fp32 on CPU (SDPA's fastest there) and in the model's elsewhere
    kv_dtype = model_dtype if options.kv_cache_dtype == "auto" else torch.float32
    attend_dtype = torch.float32 if device.type == "cpu" else model_dtype
    kv_element_size = torch.empty((), dtype=kv_dtype).element_size()
    layout = PageLayout.of(config.windows)  # hybrid models: a block per layer group
    block_bytes = (config.kv_elements_per_position * layout.slots // config.n_layers
                   * options.block_size * kv_element_size)
    num_blocks = options.cache_bytes // block_bytes
    if num_blocks < 2:
        raise ValueError(f"cache_bytes={options.cache_bytes} holds {num_blocks} KV blocks "
                         f"of {block_bytes} bytes; the engine needs at least 2")
    pool = KVPool(config.n_layers, config.n_kv_heads, config.head_dim, num_blocks,
                  options.block_size, kv_dtype, device, windows=config.windows,
                  attend_dtype=attend_dtype)
    cache = PrefixCache(num_blocks, options.block_size, block_bytes,
                        indexing=options.prefix_cache, window_groups=layout.groups - 1,
                        window=layout.window)
    return pool, cache


class Engine:
    """The sampling engine of models of `config` on `device`, built as `options` says: a
    KV pool of `options.cache_bytes` (in `model_dtype`, or fp32 as `kv_cache_dtype` says;
    attention reads it in fp32 on CPU, where SDPA is fastest), a prefix cache over its
    blocks, the per-request limits, and the engine thread."""

    def __init__(
        self,
        config: ModelConfig,
        options: SamplerOptions,
        device: torch.device,
        model_dtype: torch.dtype = torch.float32,
        decode: Callable[[list[int]], str] | None = None,
        ledger: UsageLedger | None = None,
        seed: int = 0,
        max_prefill_tokens: int = 2048,
    ) -> None:
        pool, cache = _pool_and_cache(config, options, device, model_dtype)
        layout = pool.layout
        self.options = options
        self.cache = cache
        self.limits = RequestLimits(max_samples=options.max_running,
                                    max_kv_bytes=options.max_kv_bytes,
                                    kv_element_size=pool.k.element_size())
        self.deterministic = options.deterministic
        self._decode = decode
        self._ledger = ledger
        self._seed_rng = random.Random(seed)
        self._submit_lock = threading.Lock()  # guards the seed generator and closing
        self._stats_lock = threading.Lock()  # guards the scheduler between steps
        # padded positions per prefill forward: 2048 ran tiny 8x512 prefills ~10% faster
        # than one 4096-position forward (bench_prefill.py), smaller ones fit the caches
        # what no window reads is freed: every block when every layer has a window, the
        # windowed groups' blocks in a hybrid layout
        windows = config.windows
        self.scheduler = Scheduler(
            cache, decode, ledger, options.max_running, max_prefill_tokens,
            release_window=max(windows) if all(windows) else layout.window,
            groups=layout.groups)
        # the engine thread's forwards pick their torch thread count by timing (threads.py);
        # a bf16/fp16 model's matmuls on CPU run in oneDNN, whose rounding changes with the
        # thread count (docs/architecture.md "Determinism"): a deterministic engine keeps one
        low_precision_cpu = device.type == "cpu" and model_dtype != torch.float32
        tuning = options.thread_tuning and not (options.deterministic and low_precision_cpu)
        self.threads = ThreadTuner(enabled=tuning)
        self.runner = ModelRunner(pool, self.threads, share_keys=options.shared_prefix_attention)
        self._queue: queue.SimpleQueue[list[Request] | None] = queue.SimpleQueue()
        self._gate = threading.Event()
        self._gate.set()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="prefixgym-engine", daemon=True)
        self._thread.start()

    # ---- caller side -------------------------------------------------------------

    def submit(
        self, prompt: list[int], model: Transformer, version: int, params: SamplingParams,
        num_samples: int = 1, include_prompt_logprobs: bool = False,
    ) -> APIFuture[SampleResponse]:
        """Validate and queue one request. Raises ValueError for bad input."""
        item = RoundItem(prompt, params, num_samples, include_prompt_logprobs)
        return self.submit_many([item], model, version)[0]

    def submit_many(
        self, items: Sequence[RoundItem], model: Transformer, version: int
    ) -> list[APIFuture[SampleResponse]]:
        """Validate every request, then queue them as one round: they enter the engine
        in this order, in the same step. Raises ValueError (naming the request's index
        in a round of several) for bad input, queueing none of them."""
        requests: list[Request] = []
        for i, item in enumerate(items):
            try:
                req = new_request(item, model, version, self._decode is not None, self.limits)
                bs = self.cache.block_size
                need = blocks_needed(req, 0, bs, self.scheduler.groups)
                if need > self.cache.num_blocks - 1:  # the pool must hold one request alone
                    raise ValueError(
                        f"this request may need {need} KV blocks of {bs} positions (prompt "
                        f"{len(req.prompt)}, max_tokens {req.params.max_tokens}, "
                        f"{req.num_samples} samples) but the KV pool holds "
                        f"{self.cache.num_blocks - 1}; raise cache_bytes")
                requests.append(req)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}" if len(items) > 1 else str(e)) from None
        with self._submit_lock:
            if self._closed:
                raise RuntimeError("the engine is closed; create a new LocalService")
            for req in requests:
                seed = req.params.seed
                req.seed = seed if seed is not None else self._seed_rng.getrandbits(63)
            if requests:
                self._queue.put(requests)
        return [r.future for r in requests]

    def pause(self) -> None:
        """Hold the engine (requests queue up) until `resume`. For tests and benches."""
        self._gate.clear()

    def resume(self) -> None:
        self._gate.set()

    def close(self) -> None:
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._gate.set()
        self._thread.join()

    def stats(self) -> dict[str, int]:
        return dict(self.scheduler.counters)

    def cache_stats(self) -> dict[str, int]:
        with self._stats_lock:
            return self.cache.stats()

    def check_integrity(self) -> None:
        """The cache's invariants, and its refcounts and promises against the requests'."""
        with self._stats_lock:
            self.scheduler.check_integrity()

    # ---- engine thread -----------------------------------------------------------

    def step(self) -> None:
        """One batch: schedule, run, postprocess. An exception in any of them fails the
        requests the scheduler was handling (all in flight if it names none) with it."""
        scheduler = self.scheduler
        try:
            batch = scheduler.schedule()
            if batch is not None:
                start = time.perf_counter()
                output = self.runner.run(batch)
                if self._ledger is not None:  # the forward's seconds, by kind
                    self._ledger.add_seconds(batch.kind, time.perf_counter() - start)
                scheduler.postprocess(batch, output)
        except Exception as error:  # noqa: BLE001 - handed to the requests it concerns
            scheduler.fail(scheduler.handling or scheduler.in_flight(), error)

    def _loop(self) -> None:
        with torch.inference_mode():
            while self._collect():
                with self._stats_lock:
                    self.step()
        queued = list(self.scheduler.waiting)  # and the rounds a deterministic engine held back
        while not self._queue.empty():
            queued += self._queue.get_nowait() or []
        closed = RuntimeError("the engine was closed before this request finished")
        self.scheduler.fail(self.scheduler.in_flight() + queued, closed)

    def _collect(self) -> bool:
        """Move queued requests to the waiting queue, blocking only when there is no
        work and while paused; False once the engine is closed. Deterministic: one
        round at a time, taken only once the previous round has finished."""
        busy = self.scheduler.has_work()
        if self.deterministic and busy:
            return not self._closed
        rounds = [] if busy else [self._queue.get()]
        self._gate.wait()
        while not self.deterministic and not self._queue.empty():  # (this thread alone takes)
            rounds.append(self._queue.get_nowait())
        for taken in rounds:
            if taken is None:
                return False
            self.scheduler.waiting.extend(taken)
        return True
