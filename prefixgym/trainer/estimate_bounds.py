"""The bounds of a run's estimate: how far the run can stray from its pilot, and why.

A pilot measures a few units (steps, evaluations) of each part; the run has more of
them, and for GRPO and the evaluations a policy trained further than the pilot's.
What that can change, and how far:

1) the warm start's episodes are the expert's whatever the weights: its steps are a
   sample of the run's, and a total of N steps from n lies within `Z` standard errors
   (`sampled_total`), stage by stage;
2) a policy that changes plays other episodes: the warm start teaches the expert's,
   so the run's episodes are as long as the pilot policy's or the experts' (episode
   length: a datum's positions), or anywhere between, give or take `LENGTH_SLACK` for
   GRPO going beyond both (`Shape`). Samples and datum positions grow with an
   episode's length, its prompts with its square (each turn reads the history
   again): `lengthened`;
3) a policy that converges shares all it can: at entropy zero a group's G samples are
   one, its prompts after the first turn computed once, and its rewards equal, so
   GRPO skips it and trains nothing (`converged`, the low bound); a policy that shares
   no more than the pilot's and trains every group is the high bound
   (`all_groups_trained`). The estimate is halfway;
4) seconds: each pass's in proportion to its tokens (`Unit.seconds_for`), from alone
   on the machine to a load average of `MAX_LOAD_PER_CORE` per core (`load_factors`).
`estimate_parts` builds each part from these. Knows `Usage`, metrics records and
trace lines; nothing of engines or configs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prefixgym.trainer.report import usage_of
from prefixgym.types import JSONObject, Usage

Z = 3.0
"""Standard errors either side of a sampled total (about 99.7% of a normal)."""
MAX_LOAD_PER_CORE = 4.0
"""The highest load average per core the high bound of seconds allows for (8 on 2
cores: the run gets a quarter of the processor time it would alone)."""
LENGTH_SLACK = 0.1
"""How far beyond both the pilot policy's and the experts' episode lengths GRPO may
take the run's, either way (the default run's evaluations came 0.4% past its
expert's; the addition recipe, which has no expert, shortened its replies 10%)."""


def scaled(usage: Usage, factor: float) -> Usage:
    return Usage(**{k: round(getattr(usage, k) * factor) for k in Usage.model_fields})


def midpoint(low: Usage, high: Usage) -> Usage:
    return Usage(**{k: round((getattr(low, k) + getattr(high, k)) / 2)
                    for k in Usage.model_fields})


def sampled_total(values: Sequence[float], units: int) -> tuple[float, float, float]:
    """(estimate, low, high) of a total of `units` draws like `values`: the mean times
    `units`, `Z` standard errors of that total either side (the mean is uncertain by
    sd/sqrt(n) a unit, and the run's own units vary by sd each), at least 0."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    half = Z * sd * math.sqrt(units + units * units / n)
    return mean * units, max(mean * units - half, 0.0), mean * units + half


def load_factors(load: float, cores: int, max_load: float | None = None,
                 ) -> tuple[float, float]:
    """How much faster (alone on the machine) and slower (at a load average of
    `max_load`, by default `MAX_LOAD_PER_CORE` per core) than the pilot's a run's
    seconds may be, the pilot having run at a 1-minute load average `load` (itself
    included) on `cores`: a process gets about cores / load of the processor. A pilot
    that ran above `max_load` is the high bound itself."""
    share = cores / max(load, float(cores))  # of the processor the pilot had
    most = MAX_LOAD_PER_CORE * cores if max_load is None else max_load
    return share, max(share * max(most, float(cores)) / cores, 1.0)  # not below the pilot's


@dataclass(frozen=True)
class Unit:
    """One unit of a pilot's part (a step, an evaluation): its tokens and seconds, and
    the seconds of its prefill, decode and training passes, which grow with the
    prefill computed, the sampled and the train computed tokens (the rest does not)."""

    usage: Usage
    seconds: float
    prefill_s: float = 0.0
    decode_s: float = 0.0
    train_s: float = 0.0

    @classmethod
    def of(cls, record: JSONObject, usage: Usage | None = None, factor: float = 1.0,
           ) -> Unit:
        """The unit a metrics record counts; `usage` and `factor` for one scaled from it."""
        def t(key: str) -> float:
            return float(record.get(f"time/{key}_s", 0.0)) * factor

        return cls(usage_of(record) if usage is None else usage,
                   t("step") or t("eval"), t("prefill"), t("decode"), t("forward_backward"))

    def seconds_for(self, usage: Usage) -> float:
        """This unit's seconds had it counted `usage` instead."""
        def ratio(term: str) -> float:
            mine = getattr(self.usage, f"{term}_tokens")
            return getattr(usage, f"{term}_tokens") / mine if mine else 1.0

        rest = max(self.seconds - self.prefill_s - self.decode_s - self.train_s, 0.0)
        return (rest + self.prefill_s * ratio("prefill_computed")
                + self.decode_s * ratio("sampled") + self.train_s * ratio("train_computed"))


def mean_unit(units: Sequence[Unit]) -> Unit:
    n = len(units)
    return Unit(scaled(Usage.total(u.usage for u in units), 1 / n),
                *(sum(getattr(u, k) for u in units) / n
                  for k in ("seconds", "prefill_s", "decode_s", "train_s")))


@dataclass(frozen=True)
class Shape:
    """How long the run's episodes may be against the pilot's GRPO episodes, and where
    its first turns are, from the pilot's records and trace."""

    length_low: float = 1.0
    """The shortest of the experts' episodes (the warm start's stages) over the pilot's
    GRPO episodes (train positions per trained episode), at most 1, less
    `LENGTH_SLACK`."""
    length_high: float = 1.0
    """The longest of theirs over the pilot's, at least 1, plus `LENGTH_SLACK`."""
    first_turn_prefill: float = 0.0
    """Prefill computed by a GRPO step's first turns (one request a group), a step."""
    eval_first_turn_share: float = 0.0
    """The share of the evaluations' prefill computed that their first turns computed."""


def _positions(record: JSONObject) -> float:
    return float(record.get("tokens/train_computed", 0)) + float(
        record.get("tokens/train_shared", 0))


def expert_length(records: Sequence[JSONObject], episodes_per_step: int) -> float:
    """Datum positions per episode of the warm-start steps `records` (the expert's)."""
    return sum(map(_positions, records)) / (episodes_per_step * len(records)) if (
        records) else 0.0


def grpo_length(records: Sequence[JSONObject], groups: int, group_size: int) -> float:
    """Datum positions per trained episode of the GRPO steps `records` (0: none)."""
    trained = sum((groups - float(r.get("groups/skipped", 0.0))) * group_size
                  for r in records)
    return sum(map(_positions, records)) / trained if trained > 0 else 0.0


def shape_of(trace: Sequence[JSONObject], pilot_length: float = 0.0,
             expert_lengths: Sequence[float] = ()) -> Shape:
    """The `Shape` of a pilot: its GRPO episodes' length and the experts' (0: none
    measured), and from its trace where GRPO's first turns (`step<k>/g<i>`, turn 0) and
    the evaluations' (`eval<k>/<episode>`) are."""
    first: dict[str, int] = {}
    eval_first = eval_all = 0
    for line in trace:
        group = str(line.get("group_id") or "")
        computed = int((line.get("usage") or {}).get("prefill_computed_tokens", 0))
        first_turn = line.get("turn") == 0
        if group.startswith("step") and "/" in group:
            step = group.partition("/")[0]
            first[step] = first.get(step, 0) + (computed if first_turn else 0)
        elif group.startswith("eval"):
            eval_all += computed
            eval_first += computed if first_turn else 0
    experts = [x for x in expert_lengths if x > 0]
    low = min(experts) / pilot_length if experts and pilot_length else 1.0
    high = max(experts) / pilot_length if experts and pilot_length else 1.0
    return Shape(min(low, 1.0) * (1 - LENGTH_SLACK), max(high, 1.0) * (1 + LENGTH_SLACK),
                 sum(first.values()) / len(first) if first else 0.0,
                 eval_first / eval_all if eval_all else 0.0)


def lengthened(usage: Usage, ratio: float, train: float = 1.0) -> Usage:
    """`usage` with episodes `ratio` times as long: prompts (computed and cached) by its
    square, samples by it, datum positions by it times `train`."""
    def times(term: str, factor: float) -> int:
        return round(getattr(usage, f"{term}_tokens") * factor)

    return Usage(**{f"{t}_tokens": times(t, ratio * ratio)
                    for t in ("prefill_computed", "prefill_cached")},
                 sampled_tokens=times("sampled", ratio),
                 **{f"train_{t}_tokens": times(f"train_{t}", ratio * train)
                    for t in ("computed", "loss", "shared")})


def converged(usage: Usage, first_turn_prefill: float, group_size: int,
              ratio: float) -> Usage:
    """`usage` as a policy of entropy zero would compute it, its episodes `ratio` times
    as long: a group's samples alike, its prompts after the first turn computed once
    (`collapsed`), its samples still drawn one by one, and its rewards all equal, so
    that GRPO skips it and trains nothing."""
    return lengthened(collapsed(usage, first_turn_prefill, group_size), ratio, train=0.0)


def collapsed(usage: Usage, first_turn_prefill: float, group_size: int) -> Usage:
    """`usage` as a policy of entropy zero would compute it: a group's samples alike,
    so its prompts after the first turn and its training positions are computed once
    instead of `group_size` times (the rest served from the cache, or shared); its
    samples are still drawn one by one. The same tokens before sharing."""
    first = min(round(first_turn_prefill), usage.prefill_computed_tokens)
    prefill = first + round((usage.prefill_computed_tokens - first) / group_size)
    train = round(usage.train_computed_tokens / group_size)
    return usage.model_copy(update={
        "prefill_computed_tokens": prefill,
        "prefill_cached_tokens": usage.prefill_tokens - prefill,
        "train_computed_tokens": train,
        "train_shared_tokens": usage.train_tokens - train})


def all_groups_trained(usage: Usage, skipped: float, groups: int) -> Usage:
    """`usage` were none of a step's `groups` skipped (the pilot skipped `skipped` a
    step on average, their rewards all equal): training at the pilot's rate per
    trained group."""
    if skipped <= 0 or skipped >= groups:
        return usage
    factor = groups / (groups - skipped)
    return usage.model_copy(update={
        f"train_{k}_tokens": round(getattr(usage, f"train_{k}_tokens") * factor)
        for k in ("computed", "shared", "loss")})
