"""Supervised warm start: cross-entropy on the env's expert episodes.

A model that starts from random weights never samples a valid reply, so GRPO has no
signal. The warm start plays the env's scripted expert (`rollouts.expert`: through
the same conversation the rollouts use, each expert reply tokenized as if it had
been sampled) and trains on the reply tokens only. Knows envs, trajectories and the
training protocol; not how sampling works.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from transformers import PreTrainedTokenizerBase

from prefixgym.protocols import TrainingClient
from prefixgym.rollouts.episode import AgentGymEnv
from prefixgym.rollouts.expert import play_expert
from prefixgym.trainer.datum import num_loss_tokens, sft_datum, trainable
from prefixgym.trainer.schedule import warmup_cosine_lr
from prefixgym.types import AdamParams, Datum, Usage

SFT_SEED_BASE = 2_000_000


def expert_datums(
    envs: Sequence[AgentGymEnv], tokenizer: PreTrainedTokenizerBase, seeds: Sequence[int]
) -> list[Datum]:
    """One cross-entropy datum per expert episode, weights summing to 1 over the batch."""
    trajectories = [play_expert(envs[i % len(envs)], tokenizer, seed).trajectory
                    for i, seed in enumerate(seeds)]
    trajectories = [t for t in trajectories if trainable(t)]
    n_loss = num_loss_tokens(trajectories)
    return [sft_datum(t, n_loss) for t in trajectories]


def warm_start(
    training: TrainingClient, envs: Sequence[AgentGymEnv], tokenizer: PreTrainedTokenizerBase,
    steps: int, episodes_per_step: int, lr: float,
    on_step: Callable[[int, dict[str, float], Usage], None] | None = None,
    schedule: str = "cosine",
    warmup: float = 0.1,
    stages: Sequence[tuple[int, Sequence[AgentGymEnv]]] = (),
    start: int = 0,
    batches: Callable[[int], list[Datum]] | None = None,
) -> Usage:
    """`steps` AdamW steps of cross-entropy, each on fresh expert episodes.

    The loss is a sum over tokens; dividing the weights by the step's loss tokens
    makes the learning rate independent of episode lengths. The learning rate warms
    up linearly over the first `warmup` share of the steps (on GuessNumber, without
    it some random inits stall on a policy that ignores the env's hints; on
    Arithmetic's calls it delayed the copy), then decays (cosine) to lr/10, or stays
    at lr with `schedule="constant"`. `stages`, (steps, envs) pairs adding up to
    `steps`, replace `envs` stage by stage (one schedule over them all); the episode
    seeds run on across stages, and `on_step`'s metrics name each step's stage
    (`sft_stage`, from 1). `start` skips the steps before it (a resumed warm start: each
    step's episodes and learning rate depend on its number alone); `on_step` runs
    when nothing is in flight, so it may save the training client's state.
    `batches` (step -> datums), when given, replaces the expert's episodes (recorded
    runs: `recorded.py`). Returns the usage of the steps it ran.
    """
    floor = 1.0 if schedule == "constant" else 0.1
    total = Usage()
    plan = list(stages) or [(steps, envs)]
    if sum(n for n, _ in plan) != steps:
        raise ValueError(f"the warm-start stages cover {sum(n for n, _ in plan)} steps, "
                         f"not {steps}")
    stage_of_step = [(k + 1, stage_envs) for k, (n, stage_envs) in enumerate(plan)
                     for _ in range(n)]  # (stage number, its envs) of each step

    def batch(step: int) -> list[Datum]:
        if batches is not None:
            return batches(step)
        return expert_datums(stage_of_step[step][1], tokenizer,
                             [SFT_SEED_BASE + step * episodes_per_step + i
                              for i in range(episodes_per_step)])

    datums = batch(start) if start < steps else []
    for step in range(start, steps):
        # both requests are queued before the next batch is played: the expert's episodes
        # (Python) overlap the update, as with the hosted service's futures
        backward = training.forward_backward(datums, loss_fn="cross_entropy")
        update = training.optim_step(
            AdamParams(learning_rate=warmup_cosine_lr(step, steps, lr, warmup, floor=floor),
                       grad_clip_norm=1.0))
        if step + 1 < steps:
            datums = batch(step + 1)
        out, opt = backward.result(), update.result()
        total = total + out.usage
        if on_step is not None:
            stage = {"sft_stage": stage_of_step[step][0]} if stages else {}
            on_step(step, {**stage, "sft/loss": out.metrics["loss:sum"],
                           **{f"optim/{k}": v for k, v in opt.metrics.items()}}, out.usage)
    return total
