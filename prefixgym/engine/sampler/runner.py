"""The model runner: one `Batch` in, one forward, sampled tokens out.

`ModelRunner.run(batch)`:

1) zero the batch's never-used blocks and copy cached partial blocks into the rows'
   own blocks (the pool's `copy_block`);
2) build the inputs on the pool's device: tokens and positions, right-padded, and the
   view: for a prefill, the `PagedView` that writes each row's new keys/values through
   its block table and gathers what it attends to; for a decode step, a `DecodeView`
   over the batch's workspace, gathered from the pool only when its rows change;
3) one forward (on the thread count `threads.py` chose for this kind of step; a decode
   step of a model packed whole runs its small ops on one thread and only its matmuls
   and attention on that count: `model/wide_ops.py`);
4) for a prefill, copy each prompt's part-filled last block to its other samples; the
   prompt logprobs (and top-k) of a request that scores its prompt;
5) sample every sequence's next token from its row's logits, drawing its uniform from
   its own generator.

The runner knows nothing of waiting queues, stop conditions, retirement or the prefix
cache's index: it reads the batch and returns an `Output`.
"""

from __future__ import annotations

import torch

from prefixgym.engine.model.wide_ops import narrow
from prefixgym.engine.sampler.batch import Batch, Output
from prefixgym.engine.sampler.kv_pool import DecodeView, DecodeWorkspace, KVPool, PagedView
from prefixgym.engine.sampler.requests import Request
from prefixgym.engine.sampler.shared_keys import SharedPlan, SharedSegments
from prefixgym.engine.sampler.threads import ThreadTuner, size_bucket
from prefixgym.engine.sampler.token_sampler import RowParams, sample_tokens


class ModelRunner:
    def __init__(self, pool: KVPool, threads: ThreadTuner, share_keys: bool = True) -> None:
        self.pool = pool
        self.threads = threads
        self.share_keys = share_keys  # attend keys rows share once for all (shared_keys.py)
        self._workspaces: dict[int, DecodeWorkspace] = {}  # by weights version

    def run(self, batch: Batch) -> Output:
        pool, dev = self.pool, self.pool.device
        # 1) fresh blocks start at zero; cached partial blocks are copied, never shared
        if batch.new_blocks:
            pool.zero(batch.new_blocks)
        for src, dst, n in batch.tail_copies:
            pool.copy_block(src, dst, n)
        # 2) inputs, right-padded to the longest row
        lengths = [len(t) for t in batch.tokens]
        T = max(lengths)
        tokens_R_T = torch.tensor([t + [0] * (T - len(t)) for t in batch.tokens], device=dev)
        prefill = batch.kind == "prefill"
        view: PagedView | DecodeView
        if prefill:
            view = pool.view(batch.tables, batch.starts, lengths, T, batch.window_tables)
        else:
            view = DecodeView(pool, self._workspace(batch), batch.tables, batch.starts,
                              batch.window_tables)
        max_pos = batch.model.config.max_seq_len - 1
        positions_R_T = view.positions_R_T.clamp(max=max_pos)
        key = ((batch.kind, size_bucket(tokens_R_T.numel())) if prefill
               else (batch.kind, size_bucket(len(batch.seqs)), size_bucket(max(128, view.num_keys))))
        # 3) the forward
        with self.threads.run(key, work=tokens_R_T.numel()) as threads:
            # (a prefill's ops are large: every thread serves them)
            with narrow(1 if prefill or not batch.model.narrow_steps else threads):
                logits = batch.model(tokens_R_T, positions_R_T, kv=view,
                                     last_only=not batch.prompt_logprobs,
                                     last_index_B=view.last_index_R, check_inputs=False)
        # 4) forks and prompt logprobs
        for src, dst, n in batch.fork_copies:
            pool.copy_block(src, dst, n)
        scored = Output([], [])
        if batch.prompt_logprobs:
            scored = _score_prompt(batch.requests[0], logits[0, : lengths[0] - 1])
        # 5) one token per sequence (a prefill's samples share their request's row)
        params = [s.request.params for s in batch.seqs]
        if not params or params[0].max_tokens == 0:
            return scored
        last_S_V = logits[batch.source_rows, -1] if prefill else logits[:, -1]
        row_params = RowParams.build([p.temperature for p in params], [p.top_k for p in params],
                                     [p.top_p for p in params], device=dev)
        uniforms = [0.0 if p.temperature == 0 else s.rng.random()
                    for s, p in zip(batch.seqs, params)]
        scored.tokens, scored.logprobs = sample_tokens(last_S_V, row_params, uniforms)
        return scored

    def _workspace(self, batch: Batch) -> DecodeWorkspace:
        """The batch's decode workspace: kept while its rows stay the same sequences
        and fit, else gathered again from the pool (two versions kept at most), the
        keys rows share apart where the model can attend them so (shared_keys.py)."""
        rows: list[object] = list(batch.seqs)
        ws = self._workspaces.get(batch.version)
        if ws is None or not ws.fits(rows, batch.starts):
            pool = self.pool
            cascade = (self.share_keys and pool.device.type == "cpu"
                       and batch.model.attends_shared_keys())  # (no windowed layer)
            plan = (SharedPlan.of(batch.tables, batch.starts, pool.block_size) if cascade
                    else SharedPlan.none(len(rows)))
            needed = plan.extent(batch.starts)
            # its storage serves again where large enough, else is freed before gathering
            old = self._workspaces.pop(batch.version, None)
            if old is not None and not old.fits_elements(
                    DecodeWorkspace.elements(pool, len(rows), needed)):
                old = None
            shared = SharedSegments(pool, plan, batch.tables) if plan.segments else None
            ws = DecodeWorkspace(pool, rows, batch.tables, needed, batch.window_tables,
                                 reuse=old, offsets=plan.offsets, shared=shared)
            del old
            for stale in list(self._workspaces)[: max(0, len(self._workspaces) - 1)]:
                del self._workspaces[stale]
        self._workspaces[batch.version] = ws
        return ws


def _score_prompt(req: Request, logits_T_V: torch.Tensor) -> Output:
    """The prompt's logprobs (and top-k) from the logits of its computed positions
    (`num_cached_tokens` onwards, the last excluded); None before the scored part."""
    P, start = len(req.prompt), req.num_cached_tokens
    first_scored = P - (req.prompt_logprobs_last_n or P - 1)  # position 0 is never scored
    logp_T_V = torch.log_softmax(logits_T_V.float(), dim=-1)  # predicts prompt[start + 1:]
    targets = torch.tensor(req.prompt[start + 1 :], device=logp_T_V.device).unsqueeze(1)
    values = logp_T_V.gather(1, targets).squeeze(1).tolist()
    unscored: list[None] = [None] * first_scored
    out = Output([], [], prompt_logprobs=[*unscored, *values[first_scored - start - 1 :]])
    if req.topk_k:
        top = logp_T_V[first_scored - start - 1 :].topk(req.topk_k, dim=-1)
        rows = zip(top.indices.tolist(), top.values.tolist(), strict=True)
        out.topk_prompt_logprobs = [*unscored, *(list(zip(i, v, strict=True)) for i, v in rows)]
    return out
