"""Admission: how waiting requests become running sequences, one wave at a time.

`Admission.admit` drains the scheduler's waiting queue in waves:

1) match each request's longest cached prefix -- at most len(prompt)-1 tokens, since
   the last prompt token must be computed for its logits -- and pin it; requests that
   want prompt logprobs read nothing from the cache; a request whose next block
   another request of the wave computes waits one wave and hits the cache;
2) prefill the uncached suffixes of many requests in one right-padded forward
   (chunks of similar length; prompt-logprob requests run alone), after copying each
   cached prefix into its slot;
3) write each prompt's new full blocks into the prefix cache, pin its chain;
4) replicate a slot's KV for the request's other samples, sample first tokens.

Admission owns no state of its own: it works on the scheduler's waiting queue,
running batches, cache and counters, and hands first tokens, completions and failures
back through the callbacks it was built with. It knows nothing of decode steps,
stop checks, retirement or weights-version bookkeeping (beyond telling the scheduler,
through `note_version`, that a version is about to run).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import torch

from prefixgym.engine.kv_slots import SlotKV
from prefixgym.engine.model import Transformer
from prefixgym.engine.prefix_cache import ROOT_KEY, PrefixCache, chain_key
from prefixgym.engine.requests import Request, Sequence, new_sequences
from prefixgym.engine.threads import ThreadTuner, size_bucket
from prefixgym.engine.token_sampler import RowParams, sample_tokens

_CALL_COST_TOKENS = 64  # a forward call's fixed cost, in padded positions


class Batch:
    """The running sequences of one weights version; seqs[i] lives in slot i."""

    def __init__(self, model: Transformer, version: int) -> None:
        cfg = model.config
        self.model = model
        self.version = version
        # Running sequences keep their KV in fp32 whatever the model dtype: a bf16
        # model's keys/values are bf16 values, so this is exact, and its attention then
        # reads them without an upcast per step (the prefix cache stores the model dtype).
        self.kv = SlotKV(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.max_seq_len,
                         torch.float32)
        self.seqs: list[Sequence] = []
        self.params: RowParams | None = None  # rebuilt whenever seqs change


class Admission:
    """Moves requests from the scheduler's waiting queue into its running batches."""

    def __init__(
        self,
        cache: PrefixCache | None,
        cache_lock: threading.Lock,
        waiting: deque[Request],
        batches: dict[int, Batch],
        counters: dict[str, int],
        threads: ThreadTuner,
        *,
        note_version: Callable[[Request], None],
        advance: Callable[[Batch, range, list[int], list[float]], None],
        complete: Callable[[Request], None],
        fail: Callable[[Request, BaseException], None],
    ) -> None:
        self.cache = cache
        self.cache_lock = cache_lock
        self._waiting = waiting
        self._batches = batches
        self._counters = counters
        self._threads = threads
        self._note_version = note_version
        self._advance = advance  # appends first tokens, retires rows that stopped
        self._complete = complete
        self._fail = fail

    def admit(self, max_running: int, max_prefill_tokens: int) -> None:
        """Admit waiting requests, wave after wave, while they fit under `max_running`."""
        while self._waiting:
            wave = self._next_wave(max_running)
            if not wave:
                return
            self._prefill_wave(wave, max_prefill_tokens)

    def _next_wave(self, max_running: int) -> list[Request]:
        """Pop the waiting requests that fit under `max_running` and match their cached
        prefixes. A request whose first uncached block an earlier request of this wave
        will compute waits for the next wave, where it hits the cache instead."""
        wave: list[Request] = []
        deferred: list[Request] = []
        claimed: set[int] = set()
        running = sum(len(b.seqs) for b in self._batches.values())
        while self._waiting:
            req = self._waiting[0]
            if running and running + req.num_samples > max_running:
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
        last prompt token must be computed for its logits; a request that scores its
        prompt reads none, or, with `prompt_logprobs_last_n`, only the prefix before the
        positions it scores); False = wait a wave."""
        req.num_cached_tokens = 0
        P = len(req.prompt)
        limit = P - 1
        if req.include_prompt_logprobs:
            last_n = req.prompt_logprobs_last_n
            limit = 0 if last_n is None else P - last_n - 1
        if self.cache is None or limit <= 0:
            return True
        bs = self.cache.block_size
        with self.cache_lock:
            match = self.cache.match_prefix(req.prompt, req.version, max_tokens=limit)
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

    def _prefill_wave(self, wave: list[Request], max_prefill_tokens: int) -> None:
        """Prefill a wave: one forward per chunk of similar-length suffixes; requests that
        want prompt logprobs (full logits) or no tokens run alone."""
        by_version: dict[int, list[Request]] = {}
        for req in wave:
            by_version.setdefault(req.version, []).append(req)
        for version, reqs in by_version.items():
            batch = self._batches.get(version)
            if batch is None:
                batch = self._batches[version] = Batch(reqs[0].model, version)
            self._note_version(reqs[0])
            alone = [[r] for r in reqs if r.include_prompt_logprobs or r.params.max_tokens == 0]
            together = sorted((r for r in reqs if not (r.include_prompt_logprobs
                                                       or r.params.max_tokens == 0)),
                              key=lambda r: len(r.prompt) - r.num_cached_tokens)
            for chunk in alone + _chunks(together, max_prefill_tokens):
                try:
                    self._prefill(batch, chunk)
                except Exception as error:  # noqa: BLE001 - fail these requests, keep serving
                    for req in chunk:
                        self._fail(req, error)

    def _prefill(self, batch: Batch, reqs: list[Request]) -> None:
        kv, first, R = batch.kv, len(batch.seqs), len(reqs)
        num_new = sum(r.num_samples for r in reqs)
        kv.reserve(first + max(R, num_new), max(len(r.prompt) + r.params.max_tokens for r in reqs))
        # 2) copy each request's cached prefix into its prefill slot (first + r), then
        #    one forward over every request's uncached suffix, right-padded
        for r, req in enumerate(reqs):
            if req.num_cached_tokens:
                kv.write(first + r, torch.cat([b.kv for b in req.pinned], dim=3))
        starts = [r.num_cached_tokens for r in reqs]
        lengths = [len(r.prompt) - s for r, s in zip(reqs, starts)]
        T = max(lengths)
        tokens_R_T = torch.tensor([r.prompt[s:] + [0] * (T - n)
                                   for r, s, n in zip(reqs, starts, lengths)])
        view = kv.prefill_view(first, starts, lengths)
        full_logits = reqs[0].include_prompt_logprobs
        with self._threads.run(("prefill", size_bucket(tokens_R_T.numel())),
                               work=tokens_R_T.numel()):
            logits = batch.model(tokens_R_T, view.positions_R_T, kv=view,
                                 last_only=not full_logits,
                                 last_index_B=view.last_index_R)  # (R, 1, V) or (1, T, V)
        self._counters["prefill_calls"] += 1
        self._counters["prefill_positions"] += sum(lengths)
        if full_logits:
            _score_prompt(reqs[0], logits[0, :-1])
        last_R_V = logits[:, -1]
        # 3) cache each prompt's full blocks and pin them
        for r, req in enumerate(reqs):
            self.cache_blocks(req, kv, first + r, req.prompt, len(req.prompt), pin=True)
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

    def cache_blocks(
        self, req: Request, kv: SlotKV, slot: int, tokens: list[int], length: int, pin: bool
    ) -> None:
        """Write the full blocks of `tokens[:length]` (KV in `slot`) into the prefix
        cache; with `pin`, the request holds the new chain instead of its old pins."""
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


def _score_prompt(req: Request, logits_T_V: torch.Tensor) -> None:
    """The prompt's logprobs (and top-k) from the logits of its computed positions
    (`num_cached_tokens` onwards); None before the scored part."""
    P, start = len(req.prompt), req.num_cached_tokens
    first_scored = P - (req.prompt_logprobs_last_n or P - 1)  # position 0 is never scored
    logp_T_V = torch.log_softmax(logits_T_V.float(), dim=-1)  # predicts prompt[start + 1:]
    targets = torch.tensor(req.prompt[start + 1:]).unsqueeze(1)
    values = logp_T_V.gather(1, targets).squeeze(1).tolist()
    unscored: list[None] = [None] * first_scored
    req.prompt_logprobs = [*unscored, *values[first_scored - start - 1:]]
    if req.topk_k:
        top = logp_T_V[first_scored - start - 1:].topk(req.topk_k, dim=-1)
        rows = zip(top.indices.tolist(), top.values.tolist(), strict=True)
        req.topk_prompt_logprobs = [*unscored, *(list(zip(i, v, strict=True)) for i, v in rows)]


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
