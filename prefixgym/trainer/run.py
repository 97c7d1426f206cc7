"""`train(config)`: the whole job — evaluate, warm start, GRPO, report.

  1) evaluate the starting weights on held-out seeds;
  2) warm start on expert episodes (SFT), evaluate again;
  3) GRPO steps (see grpo.py), evaluating and checkpointing at intervals;
  4) write report.md and the plots.
A resumed run skips 1-2 and continues from the last checkpoint exactly.

The run is handed its clients (`Clients`) and a way to make envs; it builds neither
a service nor a client itself (`prefixgym.cli.train` does).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from prefixgym.files import write_text_atomically
from prefixgym.protocols import SamplingClient, TrainingClient
from prefixgym.rollouts.episode import AgentGymEnv
from prefixgym.rollouts.rollout import RolloutConfig
from prefixgym.trainer.checkpoint import (
    WARM_START,
    LoopState,
    load_checkpoint,
    newest_checkpoint,
    save_checkpoint,
)
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.evaluate import evaluate
from prefixgym.trainer.grpo import StepPipeline, collect, grpo_step, phase_metrics
from prefixgym.trainer.plots import write_plots
from prefixgym.trainer.progress import Progress
from prefixgym.trainer.report import MetricsLog, write_report
from prefixgym.trainer.schedule import warmup_cosine_lr
from prefixgym.trainer.sft import warm_start
from prefixgym.trainer.tracking import open_tracker
from prefixgym.types import JSONObject, Usage

RUN_CONFIG = "config.json"
"""The run's full resolved config, written when it starts (read back by --resume and
`prefixgym rollout --run`)."""


@dataclass
class Clients:
    """What a run trains and samples with."""

    training: TrainingClient
    """Trains, and publishes each update as a sampling client."""
    sampler: SamplingClient
    """Samples from the starting weights (the first evaluation)."""
    tokenizer: PreTrainedTokenizerBase
    usage: Callable[[], Usage]
    """The cumulative per-phase ledger of everything the clients computed."""


@dataclass
class RunResult:
    out: Path
    evals: list[JSONObject]  # the eval lines of metrics.jsonl
    usage: Usage


class Run:
    def __init__(
        self, config: TrainConfig, clients: Clients, make_env: Callable[[], AgentGymEnv]
    ) -> None:
        self.config = config
        self.clients = clients
        self.training = clients.training
        self.tokenizer = clients.tokenizer
        self.envs = [make_env() for _ in range(config.groups_per_step * config.group_size)]
        self.eval_envs = [make_env() for _ in range(min(config.eval_episodes, 100))]
        self.out = Path(config.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.rollout_config = RolloutConfig(
            max_tokens=config.max_tokens, temperature=config.temperature,
            lockstep=config.deterministic,
        )
        self.log = MetricsLog(self.out / "metrics.jsonl", open_tracker(config.tracker, self.out))

    def evaluate(self, sampler: SamplingClient, step: int, when: str, state: LoopState) -> None:
        with Progress(f"eval ({when})", self.config.eval_episodes, "episode",
                      self.config.progress) as progress:
            result = evaluate(
                sampler, self.tokenizer, self.eval_envs, self.config.eval_episodes,
                self.rollout_config,
                on_episodes=lambda n, done, wins: progress.update(n, success=f"{wins / done:.1%}"),
            )
        record = {"step": step, "phase": "eval", "when": when, **result.as_metrics(),
                  **phase_metrics(result.usage)}
        state.evals.append(record)
        self.log.write(record)

    def start(self, base_usage: Usage, t_start: float) -> tuple[LoopState, SamplingClient | None]:
        """A fresh run: steps 1-2. A resumed one: its newest checkpoint (the warm start's if
        no GRPO step was saved). Returns the state and the KL reference sampler."""
        c = self.config
        ckpt = newest_checkpoint(self.out) if c.resume else None
        if ckpt is not None:
            ref = None
            if c.kl_coef > 0:
                load_checkpoint(self.out / "checkpoints" / WARM_START, self.training)
                ref = self.training.save_weights_and_get_sampling_client()
            state = load_checkpoint(ckpt, self.training)
            self.log.truncate_after(state.next_step - 1)
            print(f"resuming from {ckpt} at GRPO step {state.next_step}", file=sys.stderr)
            return state, ref
        if c.resume:
            print(f"no checkpoint in {self.out / 'checkpoints'}: starting a new run",
                  file=sys.stderr)
        self.log.path.unlink(missing_ok=True)
        write_text_atomically(self.out / RUN_CONFIG, json.dumps(asdict(c), indent=2) + "\n")
        state = LoopState(next_step=0)
        # 1) the starting weights
        self.evaluate(self.clients.sampler, 0, "before training", state)
        # 2) warm start
        if c.sft_steps:
            with Progress("warm start", c.sft_steps, "step", c.progress) as progress:

                def on_step(i: int, metrics: dict[str, float], usage: Usage) -> None:
                    self.log.write({"step": 0, "phase": "sft", "sft_step": i, **metrics,
                                    "tokens/train_computed": usage.train_computed_tokens,
                                    "tokens/train_loss": usage.train_loss_tokens,
                                    "tokens/train_shared": usage.train_shared_tokens})
                    progress.update(1, loss=f"{metrics['sft/loss']:.3f}")

                state.sft_usage = warm_start(
                    self.training, self.envs, self.tokenizer, c.sft_steps,
                    c.sft_episodes_per_step, c.sft_lr, on_step=on_step,
                )
            ref = self.training.save_weights_and_get_sampling_client()
            self.evaluate(ref, 0, "after warm start", state)
        else:
            ref = self.training.save_weights_and_get_sampling_client()
        state.usage = self.clients.usage() - base_usage
        state.wall_s = time.perf_counter() - t_start
        save_checkpoint(self.out, self.training, state, name=WARM_START, config=asdict(c))
        return state, ref if c.kl_coef > 0 else None

    def _sync_before(self, step: int) -> bool:
        """Whether async step `step` must sample from the weights of the step before it,
        so that a run resumed from a checkpoint samples as the uninterrupted one did:
        a checkpoint was saved just before it, or it would sample from the weights that
        the evaluation at a checkpoint just sampled from (and left in the cache)."""
        c = self.config
        at_checkpoint = step % c.checkpoint_every == 0
        after_checkpoint_eval = ((step - 1) % c.checkpoint_every == 0
                                 and (step - 1) % c.eval_every == 0)
        return at_checkpoint or after_checkpoint_eval

    def run(self) -> RunResult:
        c = self.config
        t_start = time.perf_counter()
        base_usage = self.clients.usage()
        state, ref_sampler = self.start(base_usage, t_start)
        # what this process adds goes on top of what the checkpoint had counted
        base_usage, t_start = self.clients.usage(), time.perf_counter()
        prior_usage, prior_wall = state.usage, state.wall_s
        sampler = self.training.save_weights_and_get_sampling_client()
        pipeline = StepPipeline(
            lambda s, step: collect(s, self.tokenizer, self.envs, c, step, self.rollout_config),
            c.async_mode, sync_before=self._sync_before,
        )
        progress = Progress("GRPO", c.steps, "step", c.progress, initial=state.next_step)
        try:
            if state.next_step < c.steps:
                pipeline.start(sampler, state.next_step)
            # 3) GRPO: sample, learn, publish
            for step in range(state.next_step, c.steps):
                t0 = time.perf_counter()
                groups, sample_s = pipeline.take(sampler, step, c.steps)
                lr = (warmup_cosine_lr(step, c.steps, c.lr, warmup_frac=0.0)
                      if c.lr_schedule == "cosine" else c.lr)
                metrics, usage = grpo_step(self.training, groups, c, ref_sampler, lr)
                sampler = self.training.save_weights_and_get_sampling_client()
                pipeline.after_update(sampler, step, c.steps)
                self.log.write({"step": step, "phase": "grpo", **metrics, **phase_metrics(usage),
                                "time/sample_s": sample_s, "time/step_s": time.perf_counter() - t0})
                state.next_step = step + 1
                if state.next_step % c.eval_every == 0 or state.next_step == c.steps:
                    if c.deterministic:
                        pipeline.wait()
                    self.evaluate(sampler, state.next_step, "GRPO", state)
                if state.next_step % c.checkpoint_every == 0 or state.next_step == c.steps:
                    state.usage = prior_usage + (self.clients.usage() - base_usage)
                    state.wall_s = prior_wall + time.perf_counter() - t_start
                    save_checkpoint(self.out, self.training, state, config=asdict(c))
                progress.update(1, reward=f"{metrics['reward/mean']:.2f}",
                                hit=f"{usage.cache_hit_rate:.0%}")
        finally:
            pipeline.close()
            progress.close()
            if self.log.tracker is not None:
                self.log.tracker.close()
        # 4) report
        state.usage = prior_usage + (self.clients.usage() - base_usage)
        wall = prior_wall + time.perf_counter() - t_start
        write_report(self.out, f"prefixgym train: {c.env}", asdict(c), state.usage,
                     state.sft_usage, state.evals, wall)
        write_plots(self.out, self.log.read())
        return RunResult(self.out, state.evals, state.usage)
