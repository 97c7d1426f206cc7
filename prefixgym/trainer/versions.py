"""On-policy, checked: which weights sampled a step, and which samples the step keeps.

A sampler that knows its weights says so through two attributes: `weights_version`,
the publish number (the engine's version, `RemoteWeightSync`'s n), and, for a remote
one, `label`, what its servers report on every answer (kept per turn in
`Turn.weights_version`). Per GRPO step:
  1) lag = version of the trainer's newest weights - version of the sampler the
     step's groups came from; it must be the updates published since the step began
     sampling (0 in sync mode; up to K with --max-staleness K, 1 with --async);
  2) a trajectory with a turn labelled other than its sampler's label is refused;
  3) with a wrong lag, every trajectory of the step is refused; one above K counts
     them as stale too.
Refused trajectories are left out of training like failed episodes and counted
(`episodes/off_policy`, and `episodes/stale` for those older than K);
`sampler/version_lag` is logged every step, with `staleness/<lag>`, the trajectories
kept at that lag (summed over the steps: the run's staleness histogram), and the
mismatch between the sampler's logprobs and the trainer's for the same tokens (the
trainer's before its update, from the step's forward_backward), over the tokens the
step trained on, says how far the sampler's numbers are from the trainer's (float
noise on-policy, one update's worth in async mode): `logprob_mismatch`.
This module knows samplers only through those two optional attributes; samplers
that have neither (an unpinned remote server) are not checked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prefixgym.protocols import SamplingClient
from prefixgym.rollouts.types import TrajectoryGroup
from prefixgym.types import Datum, ForwardBackwardOutput


def weights_version(sampler: SamplingClient) -> int | None:
    """The publish number of a sampler's weights, where it says."""
    version = getattr(sampler, "weights_version", None)
    return version if isinstance(version, int) else None


def weights_label(sampler: SamplingClient) -> str | None:
    """The label a remote sampler's answers carry, where it has one."""
    label = getattr(sampler, "label", None)
    return label if isinstance(label, str) else None


@dataclass
class StepWeights:
    """Which weights a step's samples came from and which the trainer holds."""

    sampled_with: SamplingClient
    newest: SamplingClient
    expected_lag: int
    max_staleness: int = 1  # K: a sample more versions behind than this is stale


def keep_on_policy(groups: Sequence[TrajectoryGroup], weights: StepWeights
                   ) -> tuple[list[TrajectoryGroup], dict[str, float]]:
    """Steps 1-3: the groups with refused trajectories left out, and the metrics."""
    used, newest = weights_version(weights.sampled_with), weights_version(weights.newest)
    metrics: dict[str, float] = {}
    lag_ok, lag = True, None
    if used is not None and newest is not None:
        lag = newest - used
        metrics["sampler/version_lag"] = float(lag)
        lag_ok = lag == weights.expected_lag <= weights.max_staleness  # 1)
    label = weights_label(weights.sampled_with)
    kept_groups, refused = [], 0
    for group in groups:
        kept = [t for t in group.trajectories
                if lag_ok and (label is None or all(  # 2) 3)
                    turn.weights_version in (None, label) for turn in t.turns))]
        refused += len(group.trajectories) - len(kept)
        kept_groups.append(TrajectoryGroup(group.group_id, group.seed, kept))
    metrics["episodes/off_policy"] = float(refused)
    if lag is not None:
        stale = lag > weights.max_staleness
        metrics["episodes/stale"] = float(refused if stale else 0)
        metrics[f"staleness/{lag}"] = float(sum(len(g.trajectories) for g in kept_groups))
    return kept_groups, metrics


def logprob_mismatch(datums: Sequence[Datum], out: ForwardBackwardOutput) -> dict[str, float]:
    """Over the datums' trained tokens, with d = trainer logprob - sampler logprob:
    `sampler/max_logprob_gap` and `sampler/mean_logprob_gap` (max and mean |d|),
    `sampler/kl_k3` (mean of e^d - 1 - d, the k3 estimate of KL(sampler || trainer)
    from the sampler's own tokens), and, where the update was corrected
    (`off_policy_correction`), `off_policy/weight_mean` and the fraction of trained
    tokens whose weight was capped (`off_policy/capped_fraction`) or masked
    (`off_policy/masked_fraction`), and, for a loss with a clip (ppo, gspo, cispo), the
    fraction of trained tokens it held (`loss/clip_fraction`), from the training call's
    metrics."""
    gaps: list[float] = []
    k3 = 0.0
    for datum, result in zip(datums, out.loss_fn_outputs):
        sampled = datum.loss_fn_inputs.get("logprobs")
        mask = datum.loss_fn_inputs.get("weights")
        if sampled is None or mask is None:
            continue
        for s, t, w in zip(sampled, result["logprobs"], mask):
            if w:
                d = t - float(s)
                gaps.append(abs(d))
                k3 += math.expm1(d) - d
    n = max(len(gaps), 1)
    metrics = {"sampler/max_logprob_gap": max(gaps, default=0.0),
               "sampler/mean_logprob_gap": sum(gaps) / n, "sampler/kl_k3": k3 / n}
    for key, name in (("off_policy/weight", "off_policy/weight_mean"),
                      ("off_policy/capped", "off_policy/capped_fraction"),
                      ("off_policy/masked", "off_policy/masked_fraction"),
                      ("clip_fraction", "loss/clip_fraction")):
        if key in out.metrics:
            metrics[name] = out.metrics[key]
    return metrics
