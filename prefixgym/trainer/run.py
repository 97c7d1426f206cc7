"""`train(config)`: the whole job — evaluate, warm start, GRPO, report.

  1) evaluate the starting weights on held-out seeds (unless they are a built-in
     preset's random init: `TrainConfig.eval_on_start`);
  2) warm start on expert episodes (SFT), evaluate again;
  3) GRPO steps (see grpo.py), evaluating and checkpointing at intervals;
  4) write report.md and the plots.
A resumed run skips 1-2 and continues exactly from the newest intact checkpoint of
this run (`resume.py`, `checkpoint.find_checkpoint`: the warm start's if no GRPO step was saved,
one in the middle of the warm start if it had not ended; another run's only with
`force_resume`). A run that starts from step 0 moves an
earlier metrics.jsonl aside instead of deleting it. OUT is checked writable before
anything runs, and what killed writes left there is removed.
Under torchrun (`Ranks`) every rank runs this same loop: each samples its share of a
step's groups, the groups are gathered so that every rank trains on all of them (the
training client shards and all-reduces), and only rank 0 evaluates and writes logs,
report, plots and checkpoints.

The run is handed its clients (`Clients`) and a way to make envs; it builds neither
a service nor a client itself (`prefixgym.cli.train` does).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from prefixgym.envs.registration import close_all
from prefixgym.files import ensure_writable_dir, write_text_atomically
from prefixgym.pricing import Prices
from prefixgym.protocols import SamplingClient
from prefixgym.rollouts.episode import AgentGymEnv
from prefixgym.rollouts.rollout import RolloutConfig, TraceWriter
from prefixgym.trainer.agent_steps import AgentSource
from prefixgym.trainer.checkpoint import (
    WARM_START,
    LoopState,
    in_warm_start,
    load_warm_start,
    prune_checkpoints,
    remove_leftovers,
    remove_warm_start_steps,
    save_checkpoint,
)
from prefixgym.trainer.clients import Clients, RunResult
from prefixgym.trainer.config import RUN_CONFIG, TrainConfig
from prefixgym.trainer.env_source import EnvSource
from prefixgym.trainer.grpo import StepPipeline, first_lines, grpo_step, samples_after_sync
from prefixgym.trainer.identity import run_identity
from prefixgym.trainer.plots import write_plots
from prefixgym.trainer.progress import Progress
from prefixgym.trainer.recorded import read_records, record_batches
from prefixgym.trainer.report import MetricsLog, phase_metrics, write_report
from prefixgym.trainer.resume import checkpoint_to_resume, resume_from
from prefixgym.trainer.schedule import warmup_cosine_lr
from prefixgym.trainer.sft import warm_start
from prefixgym.trainer.tracking import open_tracker
from prefixgym.types import JSONObject, Usage


class Run:
    def __init__(
        self, config: TrainConfig, clients: Clients,
        make_env: Callable[[JSONObject | None], AgentGymEnv] | None,
        pricing: tuple[Prices, str] | None = None, agent: AgentSource | None = None,
    ) -> None:
        self.config = config
        self.pricing = pricing
        """The rates report.md prices the run at, and why those (`pricing.run_prices`)."""
        self.identity = run_identity(config)
        self.clients = clients
        self.training = clients.training
        self.tokenizer = clients.tokenizer
        self.ranks = clients.ranks
        self.main = clients.ranks.is_main
        self.out = Path(config.out)
        ensure_writable_dir(self.out)
        self.rollout_config = RolloutConfig(
            max_tokens=config.max_tokens, temperature=config.temperature,
            lockstep=config.deterministic,
        )
        self.make_env = make_env or _no_env
        self.source: EnvSource | AgentSource = agent if agent is not None else EnvSource(
            config, self.tokenizer, self.make_env, self.rollout_config)
        """Where episodes come from: the env's (`env_source.py`), or an agent program's
        rollouts (`--agent`, `agent_steps.py`)."""
        self.records = read_records(config.sft_data, len(self.tokenizer)) if config.sft_data \
            else []
        """`--sft-data`'s recorded runs, read (and checked) before anything runs."""
        self.log = MetricsLog(self.out / "metrics.jsonl", open_tracker(config.tracker, self.out))
        self._prior = (Usage(), 0.0)
        """What the checkpoint resumed from had counted: usage and wall time."""
        self._since = (Usage(), 0.0)
        """This process's usage and clock when `_prior` was counted (`account`)."""
        self.trace: TraceWriter | None = None
        """Where every sampling request goes too (`--trace`), while the run runs."""

    def write(self, record: JSONObject) -> None:
        if self.main:
            self.log.write(record)

    def checkpoint(self, state: LoopState, name: str | None = None) -> None:
        """Rank 0 writes; the other ranks meet it at the barrier its write holds."""
        if self.main:
            path = save_checkpoint(self.out, self.training, state, self.identity, name=name,
                                   config=asdict(self.config), numerics=self.clients.numerics,
                                   with_optimizer=self.config.checkpoint_optimizer)
            if name is None:  # a step checkpoint: the older ones beyond keep_checkpoints go
                prune_checkpoints(path.parent, self.config.keep_checkpoints, path)
        elif self.ranks.barrier is not None:
            self.ranks.barrier()

    def evaluate(self, sampler: SamplingClient, step: int, when: str, state: LoopState) -> None:
        if not self.main:
            return
        temperature = self.config.eval_temperature
        assert temperature is not None  # resolved by TrainConfig
        t0, before = time.perf_counter(), self.clients.seconds()
        result = self.source.evaluate(sampler, temperature, when, f"eval{len(state.evals)}",
                                      self.trace)
        record = {"step": step, "phase": "eval", "when": when, **result.as_metrics(),
                  "eval/temperature": temperature,
                  **phase_metrics(result.usage), **self.clients.seconds_since(before),
                  "time/env_s": result.env_s, "time/eval_s": time.perf_counter() - t0}
        if result.env_errors:
            record["eval/first_error"] = result.first_error
            print(f"eval ({when}): {result.env_errors} of {self.config.eval_episodes} episodes "
                  f"ended in env errors, left out of success (first: {result.first_error})",
                  file=sys.stderr)
        state.evals.append(record)
        self.write(record)

    def start(self) -> tuple[LoopState, SamplingClient | None]:
        """A fresh run: steps 1-2. A resumed one: its newest checkpoint (the warm start's if
        no GRPO step was saved; one in the middle of the warm start, which then goes on).
        Returns the state and the KL reference sampler."""
        c = self.config
        removed = remove_leftovers(self.out) if self.main else []
        if removed:
            print(f"removed {len(removed)} leftover temporaries of killed writes in {self.out}",
                  file=sys.stderr)
        found = checkpoint_to_resume(self.out, self.identity, c.force_resume) if c.resume \
            else None
        if self.main and self.clients.numerics:  # what `--device`/`--compute-dtype` chose
            n = self.clients.numerics
            print(f"{c.model} on {n['device']}, training in {n['compute_dtype']}",
                  file=sys.stderr)
        for reason in found.passed_over if found else []:
            print(f"passed over: {reason}", file=sys.stderr)
        if found is not None and found.path is not None:
            ref = None  # (loading the reference loads its weights: before the checkpoint's)
            if c.kl_coef > 0 and not in_warm_start(found.path):
                ref = self.reference(found.path)
            state = resume_from(found.path, self.training, self.log if self.main else None,
                                self.clients.numerics)
            if state.next_sft_step is None:
                return state, ref
        else:
            state = self.begin()
        self._prior = (state.usage, state.wall_s)
        # 2) warm start (or the rest of it)
        if c.sft_steps:
            self.warm_start(state)
            ref = self.training.save_weights_and_get_sampling_client()
            self.evaluate(ref, 0, "after warm start", state)
        else:  # publishing is not free with remote samplers: only for the KL reference
            ref = self.training.save_weights_and_get_sampling_client() if c.kl_coef > 0 else None
        self.account(state)
        self.checkpoint(state, name=WARM_START)
        if self.main:
            remove_warm_start_steps(self.out / "checkpoints")
        return state, ref if c.kl_coef > 0 else None

    def begin(self) -> LoopState:
        """A new run: the log and config in place, the starting weights evaluated (step 1)."""
        c = self.config
        if c.resume and self.main:
            print(f"no intact checkpoint of this run in {self.out / 'checkpoints'}: starting a "
                  "new run", file=sys.stderr)
        if self.main:
            aside = self.log.set_aside()
            if aside is not None:
                print(f"kept the earlier {self.log.path.name} as {aside}", file=sys.stderr)
            write_text_atomically(self.out / RUN_CONFIG, json.dumps(asdict(c), indent=2) + "\n")
        state = LoopState(next_step=0, next_sft_step=0 if c.sft_steps else None)
        # 1) the starting weights, unless they are a random init (`eval_on_start`)
        if c.eval_on_start:
            self.evaluate(self.clients.sampler, 0, "before training", state)
        return state

    def warm_start(self, state: LoopState) -> None:
        """The warm start's steps from `state.next_sft_step`, checkpointed every
        `checkpoint_every` of them (its end is the warm start's own checkpoint)."""
        c = self.config
        first = state.next_sft_step or 0
        with Progress("warm start", c.sft_steps, "step", c.progress and self.main,
                      initial=first) as progress:

            wall, seconds = [time.perf_counter()], [self.clients.seconds()]  # at the last step

            def on_step(i: int, metrics: dict[str, float], usage: Usage) -> None:
                now = time.perf_counter()
                self.write({"step": 0, "phase": "sft", "sft_step": i, **metrics,
                            "tokens/train_computed": usage.train_computed_tokens,
                            "tokens/train_loss": usage.train_loss_tokens,
                            "tokens/train_shared": usage.train_shared_tokens,
                            **self.clients.seconds_since(seconds[0]),
                            "time/step_s": now - wall[0]})
                wall[0], seconds[0] = now, self.clients.seconds()
                state.sft_usage = state.sft_usage + usage
                state.next_sft_step = i + 1
                if state.next_sft_step % c.checkpoint_every == 0 and i + 1 < c.sft_steps:
                    self.account(state)
                    self.checkpoint(state)
                progress.update(1, loss=f"{metrics['sft/loss']:.3f}")

            stages = [(stage["steps"], [self.make_env(stage["env_kwargs"])
                                        for _ in range(c.sft_episodes_per_step)])
                      for stage in c.sft_stages]
            batches = (record_batches(self.records, c.sft_episodes_per_step, c.seed)
                       if self.records else None)
            envs = self.source.envs if isinstance(self.source, EnvSource) else []
            try:
                warm_start(self.training, envs, self.tokenizer, c.sft_steps,
                           c.sft_episodes_per_step, c.sft_lr, on_step=on_step,
                           schedule=c.sft_lr_schedule, warmup=c.sft_warmup, stages=stages,
                           start=first, batches=batches)
            finally:
                close_all(env for _, envs in stages for env in envs)
        state.next_sft_step = None

    def account(self, state: LoopState) -> None:
        """Bring the state's cumulative usage and wall time up to now: what the checkpoint
        it was loaded from counted (`_prior`), plus what this process has computed and
        spent since (`_since`)."""
        (usage, wall), (base_usage, t_start) = self._prior, self._since
        state.usage = usage + (self.clients.usage() - base_usage)
        state.wall_s = wall + time.perf_counter() - t_start

    def reference(self, resumed_from: Path) -> SamplingClient:
        """The KL reference of a resumed run: its warm-start weights, checked."""
        load_warm_start(self.out, self.identity, self.training, resumed_from,
                        self.config.force_resume)
        return self.training.save_weights_and_get_sampling_client()

    def run(self) -> RunResult:
        """The run (steps 1-4); every env it made, and its trace, are closed at its end,
        however it ends."""
        stream = open(self.trace_path(), "w") if self.config.trace else None  # noqa: SIM115
        self.trace = TraceWriter(stream) if stream is not None else None
        try:
            return self._run()
        finally:
            self.source.close()
            if stream is not None:
                stream.close()

    def trace_path(self) -> Path:
        """`--trace`, or under torchrun for rank N > 0, FILE.rankN.jsonl beside it."""
        path = Path(self.config.trace)
        rank = self.ranks.rank
        return path if rank == 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")

    def _run(self) -> RunResult:
        """Steps 1-2 (`start`), 3 (a `_grpo_step` at a time, evaluating and checkpointing
        at intervals), 4 (`_report`)."""
        c = self.config
        self._since = (self.clients.usage(), time.perf_counter())
        state, ref_sampler = self.start()
        # what this process adds goes on top of what the checkpoint had counted
        self._prior = (state.usage, state.wall_s)
        self._since = (self.clients.usage(), time.perf_counter())
        sampler = self.training.save_weights_and_get_sampling_client()
        pipeline = StepPipeline(
            lambda s, step: self.source.collect(s, step, self.ranks.rank, self.ranks.world,
                                                self.trace), c.staleness,
                                sync_before=lambda step: samples_after_sync(c, step))
        progress = Progress("GRPO", c.steps, "step", c.progress and self.main,
                            initial=state.next_step)
        try:
            if state.next_step < c.steps:
                pipeline.start(sampler, state.next_step)
            for step in range(state.next_step, c.steps):  # 3) GRPO
                sampler, metrics, usage = self._grpo_step(step, pipeline, sampler, ref_sampler)
                state.next_step = step + 1
                if state.next_step % c.eval_every == 0 or state.next_step == c.steps:
                    if c.deterministic:
                        pipeline.wait()
                    self.evaluate(sampler, state.next_step, "GRPO", state)
                if state.next_step % c.checkpoint_every == 0 or state.next_step == c.steps:
                    self.account(state)
                    self.checkpoint(state)
                progress.update(1, reward=f"{metrics['reward/mean']:.2f}",
                                hit=f"{usage.cache_hit_rate:.0%}")
        finally:
            pipeline.close()
            progress.close()
            if self.log.tracker is not None:
                self.log.tracker.close()
        self.account(state)
        self._report(state)  # 4)
        return RunResult(self.out, state.evals, state.usage)

    def _grpo_step(self, step: int, pipeline: StepPipeline, sampler: SamplingClient,
                   ref_sampler: SamplingClient | None,
                   ) -> tuple[SamplingClient, dict[str, float], Usage]:
        """3) GRPO step `step`: sample (or take what was sampled ahead), learn, publish, log.
        Returns the new weights' sampler, the step's metrics and its usage."""
        c = self.config
        t0, before = time.perf_counter(), self.clients.seconds()
        (groups, sample_s), weights = pipeline.take(sampler, step, c.steps)
        if self.ranks.gather is not None:  # every rank trains on every rank's groups
            groups = self.ranks.gather(groups)
        lr = (warmup_cosine_lr(step, c.steps, c.lr, warmup_frac=0.0)
              if c.lr_schedule == "cosine" else c.lr)
        metrics, usage = grpo_step(self.training, groups, c, ref_sampler, lr, weights,
                                   self.trace)
        sampler = self.training.save_weights_and_get_sampling_client()
        pipeline.after_update(sampler, step, c.steps)
        if self.clients.sampler_metrics is not None:
            metrics.update(self.clients.sampler_metrics())
        env_s = sum(t.env_s for g in groups for t in g.trajectories)
        notes = first_lines(groups)
        if "episodes/first_error" in notes and self.main:
            print(f"step {step}: {metrics['episodes/failed']:.0f} episodes failed "
                  f"(first: {notes['episodes/first_error']})", file=sys.stderr)
        self.write({"step": step, "phase": "grpo", **metrics, **notes,
                    **phase_metrics(usage),
                    **self.clients.seconds_since(before), "time/env_s": env_s,
                    "time/sample_s": sample_s, "time/step_s": time.perf_counter() - t0})
        return sampler, metrics, usage

    def _report(self, state: LoopState) -> None:
        """4) report.md and the plots, by rank 0."""
        if not self.main:
            return
        c = self.config
        records = self.log.read()
        write_report(self.out, f"prefixgym train: {c.agent or c.env}", asdict(c), state.usage,
                     state.sft_usage, state.evals, state.wall_s, self.clients.numerics,
                     records, self.pricing)
        write_plots(self.out, records)


def _no_env(_: JSONObject | None) -> AgentGymEnv:
    raise ValueError("this run has no env (it trains an agent program's rollouts)")
