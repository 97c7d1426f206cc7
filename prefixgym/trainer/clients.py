"""What a training run trains and samples with (`Clients`), its place in a torchrun job
(`Ranks`) and what it returns (`RunResult`): plain data the CLI builds and `Run` reads.
Knows the client protocols and the rollout types; not how a run goes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from prefixgym.protocols import SamplingClient, TrainingClient
from prefixgym.rollouts.types import TrajectoryGroup
from prefixgym.types import JSONObject, Usage


@dataclass
class Ranks:
    """This process's place in a torchrun job; the default is the only process."""

    rank: int = 0
    world: int = 1
    gather: Callable[[list[TrajectoryGroup]], list[TrajectoryGroup]] | None = None
    """Every rank's groups of one step, in group order, on every rank (a collective)."""
    barrier: Callable[[], None] | None = None
    """Waits for every rank (a collective); stands in for rank 0's checkpoint writes."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


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
    sampler_metrics: Callable[[], dict[str, float]] | None = None
    """Per-sampler counters to log with each step (several remote samplers)."""
    ranks: Ranks = field(default_factory=Ranks)
    numerics: JSONObject | None = None
    """How the trainer computes (compute_dtype, threads, device), saved with each checkpoint:
    a resume that computes otherwise says its steps will not repeat the saved run's bits."""
    seconds: Callable[[], dict[str, float]] = dict
    """The cumulative seconds per phase the clients' engine and trainer timed (none for
    a hosted backend)."""

    def seconds_since(self, before: dict[str, float]) -> dict[str, float]:
        """`time/<phase>_s` for the seconds each phase took since `before` was read."""
        now = self.seconds()
        return {f"time/{phase}_s": now[phase] - before.get(phase, 0.0) for phase in now}


@dataclass
class RunResult:
    out: Path
    evals: list[JSONObject]  # the eval lines of metrics.jsonl
    usage: Usage
