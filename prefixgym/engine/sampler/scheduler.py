"""The scheduler: which requests run next, and what their results change.

`schedule()` returns the next `Batch`: a prefill (requests leaving the waiting queue)
whenever waiting requests fit, else one decode step over every running sequence of
one weights version (versions take turns). `postprocess(batch, output)` applies what
the model runner computed: tokens appended, stop checks, retirement, cache insertion,
futures completed. Neither calls the other or the runner.

Admission, in `schedule()`: requests leave the waiting queue as a wave, while they fit
under `max_running` rows and the KV pool can promise every block they may need
(`PrefixCache.can_reserve`); the first that does not fit waits, and so does everything
behind it. The queue's head goes cached-first (admission.py: longest cached prefix,
then arrival order; arrival order alone thrashes a pool a turn outgrows). Each takes
its longest cached prefix (at most len(prompt)-1 tokens, since the last prompt token
must be computed for its logits; a request that scores its prompt reads none, or, with
`prompt_logprobs_last_n`, only the prefix before the positions it scores). A request
whose first uncached block an earlier request of the wave will compute waits one wave
and hits the cache instead. A request whose prompt (and weights version) is that of
one already in the wave computes nothing: it joins that request, whose prefill row its
samples sample from, sharing its prompt blocks as the request's own samples do (an
evaluation's or a round's identical first prompts are computed once, not once each).
Its samples keep their own generators, seeded from its own seed, so what it draws
depends on its seed and the shared logits only; its usage counts its whole prompt as
cached. (An engine without its prefix cache joins none: it is the peer that computes
every prompt.) The wave is prefilled in chunks of similar uncached length
(prompt-logprob and zero-token requests alone), each laid out by batch.py. A
request's G samples share its prompt's full blocks; each gets its own copy of a
part-filled last block. With sliding windows (`release_window`: the widest, when some
blocks can be freed), each decode step first drops what no window reads
(block_tables.py, which also keeps a hybrid model's table per group of layers).

Errors travel: `fail(requests, error)` fails those requests' futures and frees what
they hold; `handling` names the requests the step in progress touches (the batch's,
or the one being admitted), whom an error in scheduling, running or postprocessing
belongs to.

This module knows nothing of tensors or models beyond handing a request's model on:
block ids, token counts and futures are all it moves.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Hashable

from prefixgym.engine.model import Transformer
from prefixgym.engine.sampler import block_tables
from prefixgym.engine.sampler.admission import AdmissionOrder
from prefixgym.engine.sampler.batch import (
    Batch,
    Output,
    decode_batch,
    prefill_batch,
    prefill_chunks,
)
from prefixgym.engine.sampler.cache_integrity import check_prefix_cache
from prefixgym.engine.sampler.prefix_cache import Match, PrefixCache
from prefixgym.engine.sampler.requests import (
    Continuation,
    Request,
    blocks_needed,
    build_response,
    cache_limit,
    join_key,
    new_sequences,
    reads_cache,
)
from prefixgym.engine.usage import UsageLedger


class Scheduler:
    def __init__(
        self, cache: PrefixCache, decode: Callable[[list[int]], str] | None,
        ledger: UsageLedger | None, max_running: int, max_prefill_tokens: int,
        release_window: int = 0, groups: int = 1,
    ) -> None:
        self.cache = cache
        self.release_window = release_window  # 0: some layer sees every position
        self.groups = groups  # blocks per block of positions: one table per group
        self._decode = decode
        self._ledger = ledger
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: dict[int, list[Continuation]] = {}  # by weights version, in admission order
        self._chunks: deque[list[Request]] = deque()  # admitted, not yet prefilled
        self.handling: list[Request] = []  # those of the step in progress: its errors are theirs
        self._version_models: dict[int, weakref.ref[Transformer]] = {}  # the latest is kept
        self._turn = 0
        self._order = AdmissionOrder(cache, self._cached_tokens)
        self.counters = dict.fromkeys(
            ("prefill_calls", "prefill_positions", "decode_steps", "decoded_tokens",
             "max_batch_size", "requests_completed", "requests_failed",
             "window_dropped_blocks", "joined_requests"), 0)

    def has_work(self) -> bool:
        return bool(self.waiting or self._chunks or any(self.running.values()))

    def in_flight(self) -> list[Request]:
        """Every admitted, unfinished request."""
        reqs = [r for chunk in self._chunks for req in chunk for r in (req, *req.joined)]
        reqs += [s.request for seqs in self.running.values() for s in seqs]
        return list(dict.fromkeys(reqs))

    def check_integrity(self) -> None:
        """The cache's invariants, with its refcounts and promised blocks against what
        the admitted requests' sequences hold. Raises AssertionError."""
        refs: dict[int, int] = {}
        promised = 0
        for req in self.in_flight():
            for block in req.tail_pin + [b for s in req.sequences for b in s.blocks()]:
                refs[block] = refs.get(block, 0) + 1
            for seq in req.sequences:
                if seq.reserved < 0:
                    raise AssertionError(f"a sequence holds {seq.reserved} promised blocks")
                promised += seq.reserved
        if promised != self.cache.reserved:
            raise AssertionError(f"requests hold {promised} promised blocks, the cache "
                                 f"counts {self.cache.reserved}")
        check_prefix_cache(self.cache, refs)

    # ---- schedule ----------------------------------------------------------------

    def schedule(self) -> Batch | None:
        """The next batch: a prefill when waiting requests fit, else a decode step.
        `handling` names the requests it touches (the batch's), before touching them."""
        self.handling = []
        self._drop_dead_versions()
        if not self._chunks and self.waiting:
            self._admit_wave()
        if self._chunks:
            chunk = self._chunks.popleft()
            self.handling = chunk + [j for req in chunk for j in req.joined]
            return self._prefill_batch(chunk)
        versions = sorted(v for v, seqs in self.running.items() if seqs)
        if not versions:
            return None
        self._turn += 1
        version = versions[self._turn % len(versions)]
        self.handling = [s.request for s in self.running[version]]
        batch, dropped = decode_batch(self.cache, self.running[version], version,
                                      self.groups, self.release_window)
        self.counters["window_dropped_blocks"] += dropped
        return batch

    def _match(self, req: Request) -> Match:
        """The cached prefix `req` would take (none when it scores its whole prompt)."""
        if not reads_cache(req):
            return Match()
        return self.cache.match(req.prompt, req.version, cache_limit(req))

    def _cached_tokens(self, req: Request) -> int:
        """For the admission order; an error in it is the request's (`handling`)."""
        self.handling = [req]
        return self._match(req).num_tokens

    def _admit_wave(self) -> None:
        claimed: set[Hashable] = set()
        deferred: list[Request] = []
        wave: list[Request] = []
        leaders: dict[Hashable, Request] = {}  # by join_key: whom an identical prompt joins
        rows = sum(len(seqs) for seqs in self.running.values())
        bs = self.cache.block_size
        head = self._order.order(self.waiting)
        try:  # an error fails the request being admitted (`handling`), not the wave
            while self.waiting:
                req = self.waiting[0]
                self.handling = [req]
                P = len(req.prompt)
                if rows and rows + req.num_samples > self.max_running:
                    break
                key = join_key(req) if self.cache.indexing else None
                leader = leaders.get(key) if key is not None else None
                if leader is not None:
                    if not self._join(leader, req):
                        break
                    rows += req.num_samples
                    continue
                limit = cache_limit(req)
                match = self._match(req)
                hit = match.blocks
                if match.claim in claimed and (len(hit) + 1) * bs <= limit:
                    deferred.append(self.waiting.popleft())  # it hits the cache next wave
                    continue
                pins = match.all_blocks()
                need = blocks_needed(req, len(hit), bs, self.groups)
                if not self.cache.can_reserve(need, pinning=pins):
                    break
                self.waiting.popleft()
                self.cache.acquire(pins)
                self.cache.reserve(need)
                req.num_cached_tokens = match.num_tokens
                req.tail_pin = [] if match.tail_block is None else [
                    match.tail_block, *match.tail_window_blocks]
                req.sequences = new_sequences(req, hit, bs, self.groups, match.window_blocks)
                if reads_cache(req):
                    self.cache.record_lookup(P, req.num_cached_tokens)
                if match.claim is not None:
                    claimed.add(match.claim)
                if key is not None:
                    leaders[key] = req
                self._note_version(req)
                wave.append(req)
                rows += req.num_samples
        finally:
            self.waiting.extendleft(reversed(deferred))
            self._order.passed_over(head, wave + [j for r in wave for j in r.joined])
            single = [r for r in wave if r.include_prompt_logprobs or r.params.max_tokens == 0]
            together = sorted((r for r in wave if r not in single),
                              key=lambda r: (r.version, len(r.prompt) - r.num_cached_tokens))
            self._chunks.extend([[r] for r in single] + prefill_chunks(together, self.max_prefill_tokens))

    def _join(self, leader: Request, req: Request) -> bool:
        """Admit `req` (the queue's head) onto `leader`'s prefill, if the blocks its
        samples may take can be promised."""
        bs = self.cache.block_size
        need = blocks_needed(req, 0, bs, self.groups, joined=True)
        if not self.cache.can_reserve(need):
            return False
        self.waiting.popleft()
        self.cache.reserve(need)
        req.num_cached_tokens = len(req.prompt)  # computed once, by the leader
        req.sequences = new_sequences(req, [], bs, self.groups, joined=True)
        self.cache.record_lookup(len(req.prompt), len(req.prompt))
        self.counters["joined_requests"] += 1
        leader.joined.append(req)
        return True

    def _prefill_batch(self, reqs: list[Request]) -> Batch:
        return prefill_batch(self.cache, reqs, self.groups)

    # ---- postprocess -------------------------------------------------------------

    def postprocess(self, batch: Batch, output: Output) -> None:
        """Append each sequence's token, retire the finished, complete their requests."""
        if batch.kind == "prefill":
            self.counters["prefill_calls"] += 1
            self.counters["prefill_positions"] += sum(len(t) for t in batch.tokens)
            for req in batch.requests:
                done = req.params.max_tokens == 0  # then its first sample wrote its last block
                self.cache.insert(req.prompt, req.version, req.sequences[0].table,
                                  len(req.prompt), finished=done,
                                  window_tables=req.sequences[0].window_tables)
                self.cache.release(req.tail_pin)
                req.tail_pin = []
                req.prompt_logprobs = output.prompt_logprobs
                req.topk_prompt_logprobs = output.topk_prompt_logprobs
                for seq in req.sequences if done else ():
                    self._finish(seq, "length")
                if not done:
                    running = self.running.setdefault(req.version, [])
                    running.extend(req.sequences)
                    running.extend(s for j in req.joined if not j.future.done()
                                   for s in j.sequences)
                    req.joined = []
        else:
            self.counters["decode_steps"] += 1
            self.counters["decoded_tokens"] += len(batch.seqs)
            self.counters["max_batch_size"] = max(self.counters["max_batch_size"],
                                                  len(batch.seqs))
        for seq, token, logprob in zip(batch.seqs, output.tokens, output.logprobs):
            if seq.request.future.done():
                continue  # one of its request's samples failed it
            req, params = seq.request, seq.request.params
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            try:
                stop = token in params.stop_token_ids or bool(params.stop and self._hits_stop(seq))
            except Exception as error:  # noqa: BLE001 - the caller's decode failed: its request fails
                self.fail([req], error)
                continue
            if stop or len(seq.tokens) >= params.max_tokens:  # its blocks enter the index
                self.cache.insert(req.prompt + seq.tokens, req.version, seq.table, seq.kv_len,
                                  finished=True, window_tables=seq.window_tables)
                self._finish(seq, "stop" if stop else "length")
        for version, seqs in self.running.items():
            self.running[version] = [s for s in seqs if s.stop_reason is None]

    def _hits_stop(self, seq: Continuation) -> bool:
        """Whether the text of the last tokens (4 per character of the longest stop
        string, and 4 more) holds a stop string."""
        assert self._decode is not None
        stops = seq.request.params.stop
        text = self._decode(seq.tokens[-(4 * max(map(len, stops)) + 4) :])
        return any(stop in text for stop in stops)

    def _finish(self, seq: Continuation, reason: str) -> None:
        """Drop the sequence's references and promises; complete its request if it was
        the last."""
        req = seq.request
        block_tables.free(self.cache, seq)
        seq.stop_reason = reason
        if all(s.stop_reason for s in req.sequences) and not req.future.done():
            response = build_response(req)
            if self._ledger is not None:
                self._ledger.add(response.usage)
            self.counters["requests_completed"] += 1
            req.future.set_result(response)
            req.sequences = []  # (they point back at it: no cycle keeps its model alive)

    def fail(self, requests: list[Request], error: BaseException) -> None:
        """Fail these requests with `error`, wherever they are, and free what they hold
        (with a request not yet prefilled, those joined to it, which would wait for it)."""
        failed = dict.fromkeys(r for req in requests for r in (req, *req.joined))
        for req in failed:
            for seq in req.sequences:
                block_tables.free(self.cache, seq)
                seq.stop_reason = seq.stop_reason or "error"
            self.cache.release(req.tail_pin)
            req.tail_pin = []
            if not req.future.done():  # (a batch failed after postprocess finished some)
                self.counters["requests_failed"] += 1
                req.future.set_exception(error)
            req.sequences = []
        self.waiting = deque(r for r in self.waiting if r not in failed)
        chunks = ([r for r in chunk if r not in failed] for chunk in self._chunks)
        self._chunks = deque(chunk for chunk in chunks if chunk)
        for version, seqs in self.running.items():
            self.running[version] = [s for s in seqs if not s.request.future.done()]

    # ---- weights versions --------------------------------------------------------

    def _note_version(self, req: Request) -> None:
        """A newer version demotes older versions' cache blocks (evicted first)."""
        if req.version > max(self._version_models, default=-1):
            for version in self._version_models:
                self.cache.demote_version(version)
        self._version_models.setdefault(req.version, weakref.ref(req.model))

    def _drop_dead_versions(self) -> None:
        """A version whose model nobody holds (no client, no request) loses its blocks."""
        latest = max(self._version_models, default=-1)
        dead = [v for v, ref in self._version_models.items()
                if v != latest and not self.running.get(v) and ref() is None]
        for version in dead:
            del self._version_models[version]
            self.running.pop(version, None)
            self.cache.drop_version(version)

