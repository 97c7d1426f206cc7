"""Continuous batching on one background thread: admit new requests, decode all.

Callers (any thread, or asyncio through `await future`) `submit` a request and get an
`APIFuture[SampleResponse]`. The engine thread runs this loop (`_loop`):

1. collect new requests (blocking only when nothing runs);
2. admit the waiting requests in waves: match cached prefixes, batched prefill, cache
   the new blocks, fan out the G samples and sample their first tokens (admission.py);
3. one decode step per weights version: a single forward over every running
   sequence, vectorised sampling, then stop checks; finished sequences write their
   full blocks to the cache and free their slot (the last slot moves into it);
4. versions: a newer weights version demotes older versions' cache blocks (evicted
   first), an older version's slot buffer is freed once it runs nothing, and its
   blocks are dropped once nothing holds its model (no client, no request).

A bad request is refused at `submit` with a ValueError; an error inside the engine
fails only the requests it touches, and the thread keeps serving.

Deterministic mode (`deterministic=True`): a request's logprobs depend, in their last
bits, on which other rows share its forwards (a matmul of a few rows takes other
kernels than one of many). So `submit_many` queues a list of requests as one *round*
(atomically: nothing else can slip in between them), and the engine takes the next
round only when the previous one has finished: every batch it runs is then a
function of the round's requests, in their order, and the cache's contents. A caller
that submits each step of its work as one round in a fixed order (`rollouts` in
lockstep) gets the same bits every run, whatever the threads' timing.

The scheduler knows nothing of chat formats or training: it gets token ids, a
`decode(ids) -> str` for stop strings, and a model per weights version.
"""

from __future__ import annotations

import queue
import random
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import torch

from prefixgym.engine.admission import Admission, Batch
from prefixgym.engine.model import Transformer
from prefixgym.engine.prefix_cache import PrefixCache
from prefixgym.engine.requests import (
    DEFAULT_MAX_KV_BYTES,
    Request,
    RequestLimits,
    Sequence,
    build_response,
    validate_prompt_scoring,
    validate_request,
)
from prefixgym.engine.threads import ThreadTuner, size_bucket
from prefixgym.engine.token_sampler import RowParams, sample_tokens
from prefixgym.engine.usage import UsageLedger
from prefixgym.futures import APIFuture
from prefixgym.types import SampleResponse, SamplingParams


class RoundItem(NamedTuple):
    """One request of a `submit_many` round."""

    prompt: list[int]
    params: SamplingParams
    num_samples: int = 1
    include_prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None

class Scheduler:
    def __init__(
        self,
        cache: PrefixCache | None,
        decode: Callable[[list[int]], str] | None = None,
        ledger: UsageLedger | None = None,
        seed: int = 0,
        max_running: int = 256,
        max_prefill_tokens: int = 2048,
        thread_tuning: bool = True,
        max_kv_bytes: int = DEFAULT_MAX_KV_BYTES,
        deterministic: bool = False,
    ) -> None:
        self.cache = cache
        self.cache_lock = threading.Lock()
        self._decode = decode
        self._ledger = ledger
        self._seed_rng = random.Random(seed)
        self._submit_lock = threading.Lock()  # guards the seed generator and closing
        self.max_running = max_running
        self.limits = RequestLimits(max_samples=max_running, max_kv_bytes=max_kv_bytes)
        # padded positions per prefill forward: 2048 ran tiny 8x512 prefills ~10% faster
        # than one 4096-position forward (bench_prefill.py), smaller ones fit the caches
        self.max_prefill_tokens = max_prefill_tokens
        self._version_models: dict[int, weakref.ref[Transformer]] = {}
        self.deterministic = deterministic
        # an item is one request, or a round of them (`submit_many`); None closes
        self._queue: queue.SimpleQueue[Request | list[Request] | None] = queue.SimpleQueue()
        self._waiting: deque[Request] = deque()
        self._batches: dict[int, Batch] = {}
        self._latest_version = -1
        self._gate = threading.Event()
        self._gate.set()
        self._closed = False
        self.counters = dict.fromkeys(
            ("prefill_calls", "prefill_positions", "decode_steps", "decoded_tokens",
             "max_batch_size", "requests_completed", "requests_failed"), 0)
        # the engine thread's forwards pick their torch thread count by timing (threads.py)
        self.threads = ThreadTuner(enabled=thread_tuning)
        self._admission = Admission(
            cache, self.cache_lock, self._waiting, self._batches, self.counters, self.threads,
            note_version=self._note_version, advance=self._advance,
            complete=self._complete, fail=self._fail,
        )
        self._thread = threading.Thread(target=self._loop, name="prefixgym-engine", daemon=True)
        self._thread.start()

    # ---- caller side -------------------------------------------------------------

    def submit(
        self,
        prompt: list[int],
        model: Transformer,
        version: int,
        params: SamplingParams,
        num_samples: int = 1,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> APIFuture[SampleResponse]:
        """Validate and queue one request. Raises ValueError for bad input."""
        [future] = self.submit_many(
            [RoundItem(prompt, params, num_samples, include_prompt_logprobs,
                       topk_prompt_logprobs, prompt_logprobs_last_n)], model, version)
        return future

    def submit_many(
        self, requests: list[RoundItem], model: Transformer, version: int,
    ) -> list[APIFuture[SampleResponse]]:
        """Validate every request, then queue them as one round, in this order. Raises
        ValueError for bad input (naming the request's index), queueing none of them."""
        for i, item in enumerate(requests):
            try:
                validate_request(item.prompt, model, item.params, item.num_samples,
                                 self._decode is not None, self.limits)
                validate_prompt_scoring(len(item.prompt), item.include_prompt_logprobs,
                                        item.topk_prompt_logprobs,
                                        item.prompt_logprobs_last_n, model.config.vocab_size)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}" if len(requests) > 1 else str(e)) from None
        with self._submit_lock:
            if self._closed:
                raise RuntimeError("the engine is closed; create a new LocalService")
            round_: list[Request] = []
            for item in requests:
                params = item.params
                seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
                round_.append(Request(
                    list(item.prompt), item.num_samples, params,
                    item.include_prompt_logprobs or item.topk_prompt_logprobs > 0, model,
                    version, seed, topk_k=item.topk_prompt_logprobs,
                    prompt_logprobs_last_n=item.prompt_logprobs_last_n,
                    return_prompt_logprobs=item.include_prompt_logprobs))
            if round_:
                self._queue.put(round_)
        return [r.future for r in round_]

    def pause(self) -> None:
        """Hold admission and decoding (requests queue up) until `resume`. For tests."""
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

    def cache_stats(self) -> dict[str, int]:
        with self.cache_lock:
            return self.cache.stats() if self.cache is not None else {}

    def check_cache_integrity(self) -> None:
        with self.cache_lock:
            if self.cache is not None:
                self.cache.check_integrity()

    # ---- engine thread -----------------------------------------------------------

    def _loop(self) -> None:
        with torch.inference_mode():
            # 1) collect new requests (blocking only when nothing runs)
            while self._collect():
                try:
                    # 2) admit waiting requests: match, prefill, fan out (admission.py)
                    self._admission.admit(self.max_running, self.max_prefill_tokens)
                    # 3) one decode step per weights version
                    for batch in list(self._batches.values()):
                        if batch.seqs:
                            self._decode_step(batch)
                    # 4) versions: free idle slot buffers, drop versions nobody holds
                    self._drop_idle_batches()
                    self._drop_dead_versions()
                except Exception as error:  # noqa: BLE001 - last resort: the thread survives
                    for request in {s.request for b in self._batches.values() for s in b.seqs}:
                        self._fail(request, error)
            # inside inference mode: failing a running row compacts its slot buffer
            self._fail_everything(
                RuntimeError("the engine was closed before this request finished"))

    def _collect(self) -> bool:
        """Move queued requests to `_waiting`, blocking only when nothing runs and
        while paused; False once the engine is closed. Deterministic: one round at a
        time, and only once the previous round has finished."""
        busy = bool(self._waiting) or any(b.seqs for b in self._batches.values())
        if self.deterministic and busy:
            return not self._closed
        if not busy:
            first = self._queue.get()
            if first is None:
                return False
            self._take(first)
            if self.deterministic:
                self._gate.wait()
                return True
        self._gate.wait()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            self._take(item)

    def _take(self, item: Request | list[Request]) -> None:
        self._waiting.extend(item if isinstance(item, list) else [item])

    def _note_version(self, req: Request) -> None:
        """Track versions: a newer one demotes older versions' cache blocks."""
        if req.version not in self._version_models:
            self._version_models[req.version] = weakref.ref(req.model)
        if req.version > self._latest_version:
            self._latest_version = req.version
            if self.cache is not None:
                with self.cache_lock:
                    for version in self._version_models:
                        if version < req.version:
                            self.cache.demote_version(version)

    def _drop_dead_versions(self) -> None:
        """A version whose model nobody holds (no client, no request) loses its blocks."""
        dead = [v for v, ref in self._version_models.items()
                if v != self._latest_version and v not in self._batches and ref() is None]
        for version in dead:
            del self._version_models[version]
            if self.cache is not None:
                with self.cache_lock:
                    self.cache.drop_version(version)

    def _decode_step(self, batch: Batch) -> None:
        seqs = batch.seqs
        try:
            if batch.params is None:
                batch.params = RowParams.build(
                    [s.request.params.temperature for s in seqs],
                    [s.request.params.top_k for s in seqs],
                    [s.request.params.top_p for s in seqs],
                )
            tokens_B_1 = torch.tensor([[s.tokens[-1]] for s in seqs])
            positions_B = torch.tensor([s.kv_len for s in seqs])
            view = batch.kv.decode_view(positions_B)
            uniforms = [s.rng.random() if s.request.params.temperature > 0 else 0.0 for s in seqs]
            key = ("decode", size_bucket(len(seqs)), size_bucket(max(128, view.num_keys)))
            with self.threads.run(key, work=len(seqs)):
                logits_B_1_V = batch.model(tokens_B_1, positions_B.unsqueeze(1), kv=view,
                                           last_only=True)
                tokens_B, logprobs_B = sample_tokens(logits_B_1_V[:, 0], batch.params, uniforms)
            for s in seqs:
                s.kv_len += 1
        except Exception as error:  # noqa: BLE001 - fail this batch's requests, keep serving
            for request in {s.request for s in seqs}:
                self._fail(request, error)
            return
        self.counters["decode_steps"] += 1
        self.counters["decoded_tokens"] += len(seqs)
        self.counters["max_batch_size"] = max(self.counters["max_batch_size"], len(seqs))
        self._advance(batch, range(len(seqs)), tokens_B.tolist(), logprobs_B.tolist())

    def _advance(
        self, batch: Batch, rows: range, tokens: list[int], logprobs: list[float]
    ) -> None:
        """Append one token to each row, then retire the rows that stopped."""
        finished: list[int] = []
        for row, token, logprob in zip(rows, tokens, logprobs):
            seq = batch.seqs[row]
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            if token in seq.stop_token_ids or (seq.stop_strings and self._hits_stop(seq)):
                seq.stop_reason = "stop"
            elif len(seq.tokens) >= seq.max_tokens:
                seq.stop_reason = "length"
            else:
                continue
            finished.append(row)
        for row in reversed(finished):  # descending: compaction only moves rows from above
            self._retire(batch, row)

    def _hits_stop(self, seq: Sequence) -> bool:
        assert self._decode is not None
        text = self._decode(seq.tokens[-seq.stop_window :])
        return any(stop in text for stop in seq.stop_strings)

    def _retire(self, batch: Batch, row: int) -> None:
        seqs, kv = batch.seqs, batch.kv
        seq = seqs[row]
        req = seq.request
        try:
            self._admission.cache_blocks(req, kv, row, req.prompt + seq.tokens, seq.kv_len, pin=False)
        except Exception as error:  # noqa: BLE001 - caching is an optimisation
            _ = error
        _free_row(batch, row)
        req.unfinished -= 1
        if req.unfinished == 0 and not req.future.done():
            self._complete(req)

    def _complete(self, req: Request) -> None:
        self._unpin(req)
        response = build_response(req)
        if self._ledger is not None:
            self._ledger.add(response.usage)
        self.counters["requests_completed"] += 1
        req.future.set_result(response)

    def _unpin(self, req: Request) -> None:
        if self.cache is not None and req.pinned:
            with self.cache_lock:
                self.cache.release(req.pinned)
        req.pinned = []

    def _fail(self, req: Request, error: BaseException) -> None:
        batch = self._batches.get(req.version)
        if batch is not None:
            for row in reversed(range(len(batch.seqs))):
                if batch.seqs[row].request is req:
                    _free_row(batch, row)
        self._unpin(req)
        self.counters["requests_failed"] += 1
        if not req.future.done():
            req.future.set_exception(error)

    def _drop_idle_batches(self) -> None:
        for version in [v for v, b in self._batches.items() if not b.seqs]:
            if version != self._latest_version:
                del self._batches[version]

    def _fail_everything(self, error: BaseException) -> None:
        requests: list[Request] = list(self._waiting)
        requests += [s.request for b in self._batches.values() for s in b.seqs]
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, list):
                requests += item
            elif item is not None:
                requests.append(item)
        for request in dict.fromkeys(requests):
            self._fail(request, error)
        self._waiting.clear()
        self._batches.clear()

    def stats(self) -> dict[str, int]:
        return dict(self.counters)

    def slot_buffer_bytes(self) -> dict[int, int]:
        """Bytes of the running-sequence KV buffer held per weights version."""
        return {version: batch.kv.nbytes for version, batch in list(self._batches.items())}


def _free_row(batch: Batch, row: int) -> None:
    """Drop a sequence from the batch; the last row moves into its slot (compaction)."""
    seqs = batch.seqs
    last = len(seqs) - 1
    if row != last:
        batch.kv.copy_slot(last, row, seqs[last].kv_len)
        seqs[row] = seqs[last]
    seqs.pop()
    batch.params = None

