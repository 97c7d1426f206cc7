"""Continuous batching on one background thread: prefill new requests, decode all.

Callers (any thread, or asyncio through `await future`) `submit` a request and get an
`APIFuture[SampleResponse]`. The engine thread runs this loop:

1. collect new requests (blocking only when nothing runs);
2. admit each waiting request (`_admit`):
   1) match the longest cached prefix -- at most len(prompt)-1 tokens, since the last
      prompt token must be computed for its logits -- and copy it into the slot;
      requests that want prompt logprobs read nothing from the cache;
   2) prefill the rest of the prompt in one forward;
   3) write the prompt's new full blocks into the prefix cache, pin its chain;
   4) replicate the slot's KV for the other samples and sample their first tokens;
3. one decode step per weights version: a single forward over every running
   sequence, vectorised sampling, then stop checks; finished sequences write their
   full blocks to the cache and free their slot (the last slot moves into it).

A bad request is refused at `submit` with a ValueError; an error inside the engine
fails only the requests it touches, and the thread keeps serving.

The scheduler knows nothing of chat formats or training: it gets token ids, a
`decode(ids) -> str` for stop strings, and a model per weights version.
"""

from __future__ import annotations

import queue
import random
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from prefixgym.engine.kv_slots import SlotKV
from prefixgym.engine.model import Transformer
from prefixgym.engine.prefix_cache import PrefixCache
from prefixgym.engine.requests import Request, Sequence, build_response, validate_request
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
    ) -> None:
        self.cache = cache
        self.cache_lock = threading.Lock()
        self._decode = decode
        self._ledger = ledger
        self._seed_rng = random.Random(seed)
        self._submit_lock = threading.Lock()  # guards the seed generator and closing
        self.max_running = max_running
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
            running = sum(len(b.seqs) for b in self._batches.values())
            if running and running + self._waiting[0].num_samples > self.max_running:
                return
            request = self._waiting.popleft()
            try:
                self._admit(request)
            except Exception as error:  # noqa: BLE001 - fail this request, keep serving
                self._fail(request, error)

    def _admit(self, req: Request) -> None:
        batch = self._batches.get(req.version)
        if batch is None:
            batch = self._batches[req.version] = _Batch(req.model, req.version)
        self._latest_version = max(self._latest_version, req.version)
        kv, P, G, slot = batch.kv, len(req.prompt), req.num_samples, len(batch.seqs)
        kv.reserve(slot + G, P + req.params.max_tokens)
        # 1) the longest cached prefix
        cached = 0
        if self.cache is not None and not req.include_prompt_logprobs:
            with self.cache_lock:
                match = self.cache.match_prefix(req.prompt, req.version, max_tokens=P - 1)
                self.cache.record_lookup(P, match.num_tokens)
                self.cache.acquire(match.blocks)
                req.pinned = match.blocks
            if match.blocks:
                kv.write(slot, torch.cat([b.kv for b in match.blocks], dim=3))
                cached = match.num_tokens
        req.num_cached_tokens = cached
        # 2) prefill the rest
        tokens_1_T = torch.tensor(req.prompt[cached:]).unsqueeze(0)
        positions_1_T = torch.arange(cached, P).unsqueeze(0)
        logits = batch.model(tokens_1_T, positions_1_T, kv=kv.prefill_view(slot, cached, P - cached),
                             last_only=not req.include_prompt_logprobs)  # (1, T or 1, V)
        self.counters["prefill_calls"] += 1
        self.counters["prefill_positions"] += P - cached
        if req.include_prompt_logprobs:
            logp_T_V = torch.log_softmax(logits[0, :-1].float(), dim=-1)
            targets = torch.tensor(req.prompt[1:]).unsqueeze(1)
            req.prompt_logprobs = [None, *logp_T_V.gather(1, targets).squeeze(1).tolist()]
        # 3) cache the prompt's full blocks
        self._cache_blocks(req, kv, slot, req.prompt, P, pin=True)
        # 4) replicate the KV for every sample and sample the first tokens
        p = req.params
        window = 4 * max((len(s) for s in p.stop), default=0) + 4
        stop_ids = frozenset(p.stop_token_ids)
        req.sequences = [
            Sequence(req, random.Random(f"{req.seed}/{i}"), p.max_tokens, stop_ids, list(p.stop),
                     window, kv_len=P)
            for i in range(G)
        ]  # sample i draws from its own generator, derived from the request's seed
        req.unfinished = G
        if p.max_tokens == 0:
            for seq in req.sequences:
                seq.stop_reason = "length"
            self._complete(req)
            return
        for i in range(1, G):
            kv.copy_slot(slot, slot + i, P)
        batch.seqs.extend(req.sequences)
        batch.params = None
        rows = range(slot, slot + G)
        params = RowParams.build([p.temperature] * G, [p.top_k] * G, [p.top_p] * G)
        uniforms = [s.rng.random() if p.temperature > 0 else 0.0 for s in req.sequences]
        tokens_G, logprobs_G = sample_tokens(logits[0, -1:].expand(G, -1), params, uniforms)
        self._advance(batch, rows, tokens_G.tolist(), logprobs_G.tolist())

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

    def _advance(self, batch: _Batch, rows: range, tokens: list[int], logprobs: list[float]) -> None:
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
        for row in reversed(finished):
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


def _free_row(batch: _Batch, row: int) -> None:
    """Drop a sequence from the batch; the last row moves into its slot (compaction)."""
    seqs = batch.seqs
    last = len(seqs) - 1
    if row != last:
        batch.kv.copy_slot(last, row, seqs[last].kv_len)
        seqs[row] = seqs[last]
    seqs.pop()
    batch.params = None
