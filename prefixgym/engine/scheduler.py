"""Continuous batching on one background thread: prefill new requests, decode all.

Callers (any thread, or asyncio through `await future`) `submit` a request and get an
`APIFuture[SampleResponse]`. The engine thread runs this loop:

1. collect new requests (blocking only when nothing runs);
2. admit the waiting requests in waves (`_next_wave`, `_prefill`):
   1) match each one's longest cached prefix -- at most len(prompt)-1 tokens, since
      the last prompt token must be computed for its logits -- and pin it; requests
      that want prompt logprobs read nothing from the cache; a request whose next
      block another request of the wave computes waits one wave and hits the cache;
   2) prefill the uncached suffixes of many requests in one right-padded forward
      (chunks of similar length; prompt-logprob requests run alone), after copying
      each cached prefix into its slot;
   3) write each prompt's new full blocks into the prefix cache, pin its chain;
   4) replicate a slot's KV for the request's other samples, sample first tokens;
3. one decode step per weights version: a single forward over every running
   sequence, vectorised sampling, then stop checks; finished sequences write their
   full blocks to the cache and free their slot (the last slot moves into it);
4. versions: a newer weights version demotes older versions' cache blocks (evicted
   first), an older version's slot buffer is freed once it runs nothing, and its
   blocks are dropped once nothing holds its model (no client, no request).

A bad request is refused at `submit` with a ValueError; an error inside the engine
fails only the requests it touches, and the thread keeps serving.

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
from typing import Any

import torch

from prefixgym.engine.kv_slots import SlotKV
from prefixgym.engine.model import Transformer
from prefixgym.engine.prefix_cache import ROOT_KEY, PrefixCache, chain_key
from prefixgym.engine.requests import (
    Request,
    Sequence,
    build_response,
    new_sequences,
    validate_request,
)
from prefixgym.engine.token_sampler import RowParams, sample_tokens
from prefixgym.engine.usage import UsageLedger
from prefixgym.futures import APIFuture
from prefixgym.types import SampleResponse, SamplingParams


class _Batch:
    """The running sequences of one weights version; seqs[i] lives in slot i."""

    def __init__(self, model: Transformer, version: int) -> None:
        cfg = model.config
        self.model = model
        self.version = version
        dtype = next(model.parameters()).dtype
        self.kv = SlotKV(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.max_seq_len, dtype)
        self.seqs: list[Sequence] = []
        self.params: RowParams | None = None  # rebuilt whenever seqs change


class Scheduler:
    def __init__(
        self,
        cache: PrefixCache | None,
        decode: Callable[[list[int]], str] | None = None,
        ledger: UsageLedger | None = None,
        seed: int = 0,
        max_running: int = 256,
        max_prefill_tokens: int = 16384,
    ) -> None:
        self.cache = cache
        self.cache_lock = threading.Lock()
        self._decode = decode
        self._ledger = ledger
        self._seed_rng = random.Random(seed)
        self._submit_lock = threading.Lock()  # guards the seed generator and closing
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens  # padded positions per prefill forward
        self._version_models: dict[int, weakref.ref[Transformer]] = {}
        self._queue: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self._waiting: deque[Request] = deque()
        self._batches: dict[int, _Batch] = {}
        self._latest_version = -1
        self._gate = threading.Event()
        self._gate.set()
        self._closed = False
        self.counters = dict.fromkeys(
            ("prefill_calls", "prefill_positions", "decode_steps", "decoded_tokens",
             "max_batch_size", "requests_completed", "requests_failed"), 0)
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
    ) -> APIFuture[SampleResponse]:
        """Validate and queue one request. Raises ValueError for bad input."""
        validate_request(prompt, model, params, num_samples, self._decode is not None)
        with self._submit_lock:
            if self._closed:
                raise RuntimeError("the engine is closed; create a new LocalService")
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            request = Request(list(prompt), num_samples, params, include_prompt_logprobs, model,
                              version, seed)
            self._queue.put(request)
        return request.future

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
            while True:
                if not self._waiting and not any(b.seqs for b in self._batches.values()):
                    first = self._queue.get()
                    if first is None:
                        break
                    self._waiting.append(first)
                self._gate.wait()
                if not self._drain_queue():
                    break
                try:
                    self._admit_waiting()
                    for batch in list(self._batches.values()):
                        if batch.seqs:
                            self._decode_step(batch)
                    self._drop_idle_batches()
                    self._drop_dead_versions()
                except Exception as error:  # noqa: BLE001 - last resort: the thread survives
                    for request in {s.request for b in self._batches.values() for s in b.seqs}:
                        self._fail(request, error)
        self._fail_everything(RuntimeError("the engine was closed before this request finished"))

    def _drain_queue(self) -> bool:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            self._waiting.append(item)

    def _admit_waiting(self) -> None:
        while self._waiting:
            wave = self._next_wave()
            if not wave:
                return
            self._prefill_wave(wave)

    def _next_wave(self) -> list[Request]:
        """Pop the waiting requests that fit under `max_running` and match their cached
        prefixes. A request whose first uncached block an earlier request of this wave
        will compute waits for the next wave, where it hits the cache instead."""
        wave: list[Request] = []
        deferred: list[Request] = []
        claimed: set[int] = set()
        running = sum(len(b.seqs) for b in self._batches.values())
        while self._waiting:
            req = self._waiting[0]
            if running and running + req.num_samples > self.max_running:
                break
            self._waiting.popleft()
            try:
                if not self._match(req, claimed):
                    deferred.append(req)
                    continue
            except Exception as error:  # noqa: BLE001 - fail this request, keep serving
                self._fail(req, error)
                continue
            wave.append(req)
            running += req.num_samples
        self._waiting.extendleft(reversed(deferred))
        return wave

    def _match(self, req: Request, claimed: set[int]) -> bool:
        """1) pin the longest cached prefix (at most len(prompt)-1 tokens, since the
        last prompt token must be computed for its logits); False = wait a wave."""
        req.num_cached_tokens = 0
        if self.cache is None or req.include_prompt_logprobs:
            return True
        P, bs = len(req.prompt), self.cache.block_size
        with self.cache_lock:
            match = self.cache.match_prefix(req.prompt, req.version, max_tokens=P - 1)
            key = match.blocks[-1].key if match.blocks else ROOT_KEY
            computed_keys = []  # the full blocks this request will compute and cache
            for start in range(match.num_tokens, P - bs + 1, bs):
                key = chain_key(req.version, key, tuple(req.prompt[start : start + bs]))
                computed_keys.append(key)
            if computed_keys and match.num_tokens + bs <= P - 1 and computed_keys[0] in claimed:
                return False
            claimed.update(computed_keys)
            self.cache.record_lookup(P, match.num_tokens)
            self.cache.acquire(match.blocks)
            req.pinned = match.blocks
        req.num_cached_tokens = match.num_tokens
        return True

    def _prefill_wave(self, wave: list[Request]) -> None:
        """Prefill a wave: one forward per chunk of similar-length suffixes; requests that
        want prompt logprobs (full logits) or no tokens run alone."""
        by_version: dict[int, list[Request]] = {}
        for req in wave:
            by_version.setdefault(req.version, []).append(req)
        for version, reqs in by_version.items():
            batch = self._batches.get(version)
            if batch is None:
                batch = self._batches[version] = _Batch(reqs[0].model, version)
            self._note_version(reqs[0])
            alone = [[r] for r in reqs if r.include_prompt_logprobs or r.params.max_tokens == 0]
            together = sorted((r for r in reqs if not (r.include_prompt_logprobs
                                                       or r.params.max_tokens == 0)),
                              key=lambda r: len(r.prompt) - r.num_cached_tokens)
            for chunk in alone + _chunks(together, self.max_prefill_tokens):
                try:
                    self._prefill(batch, chunk)
                except Exception as error:  # noqa: BLE001 - fail these requests, keep serving
                    for req in chunk:
                        self._fail(req, error)

    def _prefill(self, batch: _Batch, reqs: list[Request]) -> None:
        kv, first, R = batch.kv, len(batch.seqs), len(reqs)
        num_new = sum(r.num_samples for r in reqs)
        kv.reserve(first + max(R, num_new), max(len(r.prompt) + r.params.max_tokens for r in reqs))
        # 1) copy each request's cached prefix into its prefill slot (first + r)
        for r, req in enumerate(reqs):
            if req.num_cached_tokens:
                kv.write(first + r, torch.cat([b.kv for b in req.pinned], dim=3))
        # 2) one forward over every request's uncached suffix, right-padded
        starts = [r.num_cached_tokens for r in reqs]
        lengths = [len(r.prompt) - s for r, s in zip(reqs, starts)]
        T = max(lengths)
        tokens_R_T = torch.tensor([r.prompt[s:] + [0] * (T - n)
                                   for r, s, n in zip(reqs, starts, lengths)])
        view = kv.prefill_view(first, starts, lengths)
        full_logits = reqs[0].include_prompt_logprobs
        logits = batch.model(tokens_R_T, view.positions_R_T, kv=view, last_only=not full_logits,
                             last_index_B=view.last_index_R)  # (R, 1, V) or (1, T, V)
        self.counters["prefill_calls"] += 1
        self.counters["prefill_positions"] += sum(lengths)
        if full_logits:
            req = reqs[0]
            logp_T_V = torch.log_softmax(logits[0, :-1].float(), dim=-1)
            targets = torch.tensor(req.prompt[1:]).unsqueeze(1)
            req.prompt_logprobs = [None, *logp_T_V.gather(1, targets).squeeze(1).tolist()]
        last_R_V = logits[:, -1]
        # 3) cache each prompt's full blocks and pin them
        for r, req in enumerate(reqs):
            self._cache_blocks(req, kv, first + r, req.prompt, len(req.prompt), pin=True)
        # 4) sample 0 stays in the prefill slot, the other samples get copies after them
        for req in reqs:
            req.sequences = new_sequences(req)
            req.unfinished = req.num_samples
        if reqs[0].params.max_tokens == 0:  # such a request runs alone
            for seq in reqs[0].sequences:
                seq.stop_reason = "length"
            self._complete(reqs[0])
            return
        seqs = [req.sequences[0] for req in reqs]
        source_rows = list(range(R))
        for r, req in enumerate(reqs):
            for seq in req.sequences[1:]:
                kv.copy_slot(first + r, first + len(seqs), len(req.prompt))
                seqs.append(seq)
                source_rows.append(r)
        batch.seqs.extend(seqs)
        batch.params = None
        params = RowParams.build([s.request.params.temperature for s in seqs],
                                 [s.request.params.top_k for s in seqs],
                                 [s.request.params.top_p for s in seqs])
        uniforms = [0.0 if s.is_greedy else s.rng.random() for s in seqs]
        tokens, logprobs = sample_tokens(last_R_V[source_rows], params, uniforms)
        self._advance(batch, range(first, first + len(seqs)), tokens.tolist(), logprobs.tolist())

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

    def _decode_step(self, batch: _Batch) -> None:
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
            logits_B_1_V = batch.model(tokens_B_1, positions_B.unsqueeze(1),
                                       kv=batch.kv.decode_view(positions_B), last_only=True)
            for s in seqs:
                s.kv_len += 1
            uniforms = [s.rng.random() if s.request.params.temperature > 0 else 0.0 for s in seqs]
            tokens_B, logprobs_B = sample_tokens(logits_B_1_V[:, 0], batch.params, uniforms)
        except Exception as error:  # noqa: BLE001 - fail this batch's requests, keep serving
            for request in {s.request for s in seqs}:
                self._fail(request, error)
            return
        self.counters["decode_steps"] += 1
        self.counters["decoded_tokens"] += len(seqs)
        self.counters["max_batch_size"] = max(self.counters["max_batch_size"], len(seqs))
        self._advance(batch, range(len(seqs)), tokens_B.tolist(), logprobs_B.tolist())

    def _advance(
        self, batch: _Batch, rows: range, tokens: list[int], logprobs: list[float]
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

    def _retire(self, batch: _Batch, row: int) -> None:
        seqs, kv = batch.seqs, batch.kv
        seq = seqs[row]
        req = seq.request
        try:
            self._cache_blocks(req, kv, row, req.prompt + seq.tokens, seq.kv_len, pin=False)
        except Exception as error:  # noqa: BLE001 - caching is an optimisation
            _ = error
        _free_row(batch, row)
        req.unfinished -= 1
        if req.unfinished == 0 and not req.future.done():
            self._complete(req)

    def _cache_blocks(
        self, req: Request, kv: SlotKV, slot: int, tokens: list[int], length: int, pin: bool
    ) -> None:
        if self.cache is None:
            return
        bs = self.cache.block_size
        with self.cache_lock:
            chain = self.cache.insert(
                tokens, req.version, lambda i: kv.read(slot, i * bs, (i + 1) * bs), max_tokens=length
            )
            if pin:
                self.cache.acquire(chain)
                self.cache.release(req.pinned)
                req.pinned = chain

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
            if item is not None:
                requests.append(item)
        for request in dict.fromkeys(requests):
            self._fail(request, error)
        self._waiting.clear()
        self._batches.clear()

    def stats(self) -> dict[str, Any]:
        return dict(self.counters)

    def slot_buffer_bytes(self) -> dict[int, int]:
        """Bytes of the running-sequence KV buffer held per weights version."""
        return {version: batch.kv.nbytes for version, batch in list(self._batches.items())}


def _free_row(batch: _Batch, row: int) -> None:
    """Drop a sequence from the batch; the last row moves into its slot (compaction)."""
    seqs = batch.seqs
    last = len(seqs) - 1
    if row != last:
        batch.kv.copy_slot(last, row, seqs[last].kv_len)
        seqs[row] = seqs[last]
    seqs.pop()
    batch.params = None


_CALL_COST_TOKENS = 64  # a forward call's fixed cost, in padded positions


def _chunks(reqs: list[Request], max_tokens: int) -> list[list[Request]]:
    """Split requests sorted by uncached length into prefill batches: a new batch starts
    when padding the batch to the newcomer's length would cost more than a call, or
    the batch would pass `max_tokens` padded positions."""
    chunks: list[list[Request]] = []
    current: list[Request] = []
    width = 0
    for req in reqs:
        n = len(req.prompt) - req.num_cached_tokens
        if current and (len(current) * (n - width) > _CALL_COST_TOKENS
                        or (len(current) + 1) * n > max_tokens):
            chunks.append(current)
            current = []
        current.append(req)
        width = n
    if current:
        chunks.append(current)
    return chunks
