"""The GRPO loop: rollouts -> group-relative advantages -> datums -> one update.

One step (numbered as in the code):
  1) sample B groups x G episodes with the current weights (with --max-staleness K,
     the next K steps' groups are sampled while this step trains: up to K versions
     off-policy; K = 1 is --async);
  2) advantages per group (equal-reward groups skipped, failed episodes left out);
  3) one complete Datum per episode, with the sampler's logprobs;
  4) forward_backward + optim_step; publish the new weights to the sampler;
  5) log per-phase tokens, evaluate and checkpoint at their intervals.
Before 2), samples from weights other than the expected ones are refused
(`versions.py`). Under torchrun each rank samples its share of the B groups
(`collect(..., rank, world)`) and every rank trains on all of them, gathered.

Knows the sampling and training protocols, envs and conversations; not the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from prefixgym.protocols import SamplingClient, TrainingClient
from prefixgym.rollouts.episode import AgentGymEnv
from prefixgym.rollouts.rollout import RolloutConfig, Rollouts, TraceWriter
from prefixgym.rollouts.types import Trajectory, TrajectoryGroup
from prefixgym.trainer.advantages import group_advantages
from prefixgym.trainer.config import TrainConfig, loss_fn_config
from prefixgym.trainer.datum import loss_mask, num_loss_tokens, rl_datum, trainable
from prefixgym.trainer.versions import StepWeights, keep_on_policy, logprob_mismatch
from prefixgym.types import AdamParams, Datum, ModelInput, Usage

Collected = tuple[list[TrajectoryGroup], float]  # one step's groups, seconds spent sampling

GRPO_SEED_BASE = 3_000_000


def step_seeds(config: TrainConfig, step: int) -> list[int]:
    """The env seeds of one step's B groups: fixed by (run seed, step), so resumable."""
    b = config.groups_per_step
    return [GRPO_SEED_BASE + config.seed * 100_000 + step * b + i for i in range(b)]


def collect(
    sampler: SamplingClient, tokenizer: PreTrainedTokenizerBase, envs: Sequence[AgentGymEnv],
    config: TrainConfig, step: int, rollout_config: RolloutConfig, rank: int = 0, world: int = 1,
    trace: TraceWriter | None = None,
) -> Collected:
    """Step 1: B groups of G episodes, all concurrently; with `world` ranks, this rank's
    groups (i % world == rank). Returns groups and seconds. Each sampling request goes
    to `trace` too, when given."""
    start = time.perf_counter()
    rollouts = Rollouts(sampler, tokenizer, rollout_config, trace)
    g = config.group_size

    groups = asyncio.run(rollouts.run_groups([
        (envs[i * g:(i + 1) * g], seed, f"step{step}/g{i}")
        for i, seed in enumerate(step_seeds(config, step)) if i % world == rank
    ]))
    return groups, time.perf_counter() - start


def assemble(
    groups: Sequence[TrajectoryGroup], config: TrainConfig,
    ref_sampler: SamplingClient | None = None, trace: TraceWriter | None = None,
) -> tuple[list[Datum], dict[str, float]]:
    """Steps 2-3: advantages, the KL penalty when asked for, and one complete datum per
    trained episode; with the counts of what was left out. The KL reference's requests
    go to `trace` too, when given."""
    chosen: list[tuple[Trajectory, float]] = []
    skipped = failed = broken = 0
    for group in groups:
        kept = [t for t in group.trajectories if not t.failed]
        failed += len(group.trajectories) - len(kept)
        if len(kept) < 2:
            skipped += 1
            continue
        adv = group_advantages([t.total_reward for t in kept], config.normalize_std)
        if adv.skipped:
            skipped += 1
            continue
        for traj, a in zip(kept, adv.advantages_G):
            for seq in [traj, *traj.branches]:  # an agent program's branches: one advantage
                if not seq.extension_ok:  # its tokens are not what was sampled from
                    broken += 1
                elif trainable(seq):
                    chosen.append((seq, a))
    metrics = {
        "groups/skipped": float(skipped), "episodes/failed": float(failed),
        "episodes/broken_extension": float(broken), "datums/count": float(len(chosen)),
    }
    penalties: list[list[float] | None] = [None] * len(chosen)
    if chosen and config.kl_coef > 0 and ref_sampler is not None:
        penalties, metrics["kl/sampled_vs_ref"] = kl_penalties(
            [t for t, _ in chosen], ref_sampler, config.kl_coef, trace)
    # The losses are sums over tokens: dividing advantages by the step's loss tokens
    # makes the update a per-token mean, so the learning rate does not depend on B, G
    # or episode length.
    n_loss = num_loss_tokens([t for t, _ in chosen])
    datums = [rl_datum(t, a, n_loss, kl) for (t, a), kl in zip(chosen, penalties)]
    return datums, metrics


def kl_penalties(
    trajectories: Sequence[Trajectory], ref_sampler: SamplingClient, kl_coef: float,
    trace: TraceWriter | None = None,
) -> tuple[list[list[float] | None], float]:
    """kl_coef * (logp_sampler - logp_ref) per datum position (a k1 KL estimate, used
    on sampled targets), and the estimate's mean over sampled targets.

    The reference logprobs come from `compute_logprobs`, which never reads the cache.
    """
    prompts = [ModelInput.from_ints(t.tokens[: t.trained_length]) for t in trajectories]
    if trace is not None:
        for prompt in prompts:
            trace.write_logprobs(prompt)
    futures = [ref_sampler.compute_logprobs(prompt) for prompt in prompts]
    penalties: list[list[float] | None] = []
    total_kl, n = 0.0, 0
    for traj, fut in zip(trajectories, futures):
        ref = fut.result()[1:]  # ref[i] = logp_ref(target i); only position 0 has none
        sampler = traj.logprobs[1 : traj.trained_length]
        penalty = [0.0] * len(sampler)
        for i, sampled in enumerate(loss_mask(traj)):
            ref_i = ref[i]
            if sampled and ref_i is not None:
                kl = sampler[i] - ref_i
                penalty[i] = kl_coef * kl
                total_kl, n = total_kl + kl, n + 1
        penalties.append(penalty)
    return penalties, total_kl / n if n else 0.0


def rollout_metrics(groups: Sequence[TrajectoryGroup]) -> tuple[dict[str, float], Usage]:
    """The step's episodes' means, over those the env played to their end (an env error
    is counted by `assemble` as `episodes/failed`, apart)."""
    trajs = [t for g in groups for t in g.trajectories if not t.failed]
    usage = Usage.total(g.usage for g in groups)
    n = max(len(trajs), 1)
    metrics: dict[str, float] = {
        "reward/mean": sum(t.total_reward for t in trajs) / n,
        "success/mean": sum(t.is_success for t in trajs) / n,
        "turns/mean": sum(len(t.turns) for t in trajs) / n,
        "invalid_actions/mean": sum(t.num_invalid_actions for t in trajs) / n,
        # what the prompts would cost if no turn shared anything with another (a group's
        # shared first turn, the prefix cache): prefill's ceiling, to read its counts by
        "tokens/turn_prompts": float(sum(turn.prompt_length for t in trajs
                                         for seq in [t, *t.branches] for turn in seq.turns)),
    }
    if any(t.branches for t in trajs):  # an agent program rewrote its history
        metrics["agent/branches"] = float(sum(len(t.branches) for t in trajs))
        metrics["tokens/branch_reprefilled"] = float(
            sum(t.branch_reprefilled_tokens for t in trajs))
    return metrics, usage


def first_lines(groups: Sequence[TrajectoryGroup]) -> dict[str, str]:
    """The step's first failed episode's error and first branch's note, for the log."""
    trajs = [t for g in groups for t in g.trajectories]
    out = {}
    failed = next((t for t in trajs if t.failed and t.error), None)
    if failed is not None:
        out["episodes/first_error"] = f"{failed.episode_id}: {failed.error}"
    branched = next((t for t in trajs if t.branch_notes), None)
    if branched is not None:
        out["agent/first_branch"] = f"{branched.episode_id}: {branched.branch_notes[0]}"
    return out


@dataclass
class _Pending:
    future: Future[Collected]
    sampler: SamplingClient
    updates: int  # the pipeline's updates when it started: its lag is counted from there


class StepPipeline:
    """Step 1 with up to K steps sampled ahead: where each step's groups come from.

    K = 0 (sync): step t+1 samples from the weights step t published, starting right
    after the update. K >= 1: when step t starts training, steps t+1 .. t+K that are not
    sampling yet start, in order, from the newest weights, so each trains at most K
    versions after the weights that sampled it (K = 1 is `--async`: step t+1 from the
    weights before step t's update). Where `sync_before(s)` (a checkpoint follows step
    s - 1), step s and those after it wait for step s - 1's weights, as a run resumed
    from that checkpoint would, so resuming is exact. One worker samples the steps one
    after another."""

    def __init__(
        self, sample_fn: Callable[[SamplingClient, int], Collected], max_staleness: int,
        sync_before: Callable[[int], bool] = lambda step: False,
    ) -> None:
        self._sample = sample_fn
        self._ahead = max_staleness
        self._sync_before = sync_before
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")
        self._pending: dict[int, _Pending] = {}
        self._updates = 0

    def start(self, sampler: SamplingClient, step: int) -> None:
        """Sample step `step` from `sampler`."""
        self._pending[step] = _Pending(self._pool.submit(self._sample, sampler, step), sampler,
                                       self._updates)

    def take(self, sampler: SamplingClient, step: int, last_step: int
             ) -> tuple[Collected, StepWeights]:
        """This step's groups, and which weights sampled them (`sampler` holds the
        newest); the steps up to K ahead start sampling now."""
        pending = self._pending.pop(step)
        result = pending.future.result()
        weights = StepWeights(pending.sampler, sampler, self._updates - pending.updates,
                              self._ahead)
        for ahead in range(step + 1, min(step + self._ahead, last_step - 1) + 1):
            if ahead in self._pending:
                continue
            if self._sync_before(ahead):
                break
            self.start(sampler, ahead)
        return result, weights

    def after_update(self, sampler: SamplingClient, step: int, last_step: int) -> None:
        """The next step samples from the freshly published weights, unless it already
        started."""
        self._updates += 1
        if step + 1 not in self._pending and step + 1 < last_step:
            self.start(sampler, step + 1)

    def wait(self) -> None:
        """Let the steps sampling ahead finish (before an evaluation, so that the two
        never share the engine's batches or interleave in its cache)."""
        for pending in self._pending.values():
            pending.future.exception()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def samples_after_sync(config: TrainConfig, step: int) -> bool:
    """Whether a step sampled ahead, `step`, must sample from the weights of the step before it,
    so that a run resumed from a checkpoint samples as the uninterrupted one did:
    a checkpoint was saved just before it, or it would sample from the weights that
    the evaluation at a checkpoint just sampled from (and left in the cache)."""
    at_checkpoint = step % config.checkpoint_every == 0
    after_checkpoint_eval = ((step - 1) % config.checkpoint_every == 0
                             and (step - 1) % config.eval_every == 0)
    return at_checkpoint or after_checkpoint_eval


def grpo_step(
    training: TrainingClient, groups: Sequence[TrajectoryGroup], config: TrainConfig,
    ref_sampler: SamplingClient | None, lr: float | None = None,
    weights: StepWeights | None = None, trace: TraceWriter | None = None,
) -> tuple[dict[str, float], Usage]:
    """Steps 2-4 on one step's groups, sampled with `weights` (checked when given).
    Returns metrics and the step's usage."""
    metrics, usage = rollout_metrics(groups)
    if weights is not None:
        groups, checked = keep_on_policy(groups, weights)
        metrics.update(checked)
    datums, counts = assemble(groups, config, ref_sampler, trace)
    metrics.update(counts)
    if datums:
        out = training.forward_backward(datums, loss_fn=config.loss,
                                        loss_fn_config=loss_fn_config(config)).result()
        metrics.update(logprob_mismatch(datums, out))
        opt = training.optim_step(
            AdamParams(learning_rate=config.lr if lr is None else lr, grad_clip_norm=1.0)
        ).result()
        usage = usage + out.usage
        metrics["loss"] = out.metrics.get("loss:sum", out.metrics.get("loss", 0.0))
        metrics.update({f"optim/{k}": v for k, v in opt.metrics.items()})
    return metrics, usage
