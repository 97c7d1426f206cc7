"""A part of a run's estimate (warm start, GRPO, evaluations) between a low and a high
bound, and the assumption behind each.

A pilot measures a few units (steps, evaluations) of each part; the run has more of
them, and for GRPO and the evaluations a policy trained further than the pilot's.
What that can change, and how far:

1) the warm start's episodes are the expert's whatever the weights: its steps are a
   sample of the run's, and a total of N steps from n lies within `Z` standard errors
   (`sampled_total`), stage by stage (`warm_start_part`);
2) a policy that changes plays other episodes: a GRPO step's or an evaluation's tokens
   before sharing lie between what they would be were every group like the pilot's
   cheapest group and like its dearest (`Shape`, from the pilot's trace);
3) a policy that sharpens shares more: at entropy zero a group's G samples are one,
   and its prompts after the first turn and its training positions are computed once,
   not G times (`collapsed`, the low bound); a policy that shares no more than the
   pilot's and trains every group (none skipped for equal rewards) is the high bound
   (`all_groups_trained`). The estimate is halfway (`policy_part`);
4) seconds: the pilot's per unit, in proportion to the tokens computed, from alone on
   the machine to a load average of `MAX_LOAD_PER_CORE` per core (`load_factors`).
A part the pilot ran in full is exact (`exact_part`). Knows `Usage`, metrics records,
trace lines and the config; nothing of engines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from prefixgym.pricing import Prices
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.report import usage_of
from prefixgym.types import JSONObject, Usage

Z = 3.0
"""Standard errors either side of a sampled total (about 99.7% of a normal)."""
MAX_LOAD_PER_CORE = 4.0
"""The highest load average per core the high bound of seconds allows for (8 on 2
cores: the run gets a quarter of the processor time it would alone)."""
TERMS = ("prefill_computed", "prefill_cached", "sampled", "train_computed", "train_shared")


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
    """What a pilot's trace says about its GRPO groups and evaluation episodes."""

    volume_low: float = 1.0
    """The pilot's cheapest GRPO group's tokens (prompts and samples) over its mean's."""
    volume_high: float = 1.0
    """Its dearest group's over its mean's."""
    first_turn_prefill: float = 0.0
    """Prefill computed by a GRPO step's first turns (one request a group), a step."""
    eval_first_turn_share: float = 0.0
    """The share of the evaluations' prefill computed that their first turns computed."""


def shape_of(trace: Sequence[JSONObject]) -> Shape:
    """The `Shape` of a pilot from its trace: GRPO groups (`step<k>/g<i>`) and
    evaluation episodes (`eval<k>/<episode>`). Without GRPO groups, volumes stay 1."""
    groups: dict[str, int] = {}
    first: dict[str, int] = {}
    eval_first = eval_all = 0
    for line in trace:
        group = str(line.get("group_id") or "")
        usage = line.get("usage") or {}
        computed = int(usage.get("prefill_computed_tokens", 0))
        first_turn = line.get("turn") == 0
        if group.startswith("step") and "/" in group:
            groups[group] = groups.get(group, 0) + computed + int(
                usage.get("prefill_cached_tokens", 0)) + int(usage.get("sampled_tokens", 0))
            step = group.partition("/")[0]
            first[step] = first.get(step, 0) + (computed if first_turn else 0)
        elif group.startswith("eval"):
            eval_all += computed
            eval_first += computed if first_turn else 0
    share = eval_first / eval_all if eval_all else 0.0
    if not groups:
        return Shape(eval_first_turn_share=share)
    mean = sum(groups.values()) / len(groups)
    return Shape(min(groups.values()) / mean, max(groups.values()) / mean,
                 sum(first.values()) / len(first), share)


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


@dataclass(frozen=True)
class Part:
    """One part of the run: `units` of `unit`; the estimate `usage` between the bounds
    `low` and `high` (their tokens before sharing, tokens computed and money) and the
    seconds; `why` says what each bound assumes. An `exact` part the pilot ran in full."""

    name: str
    label: str
    units: int
    unit: str
    usage: Usage
    low: Usage
    high: Usage
    seconds: tuple[float, float, float]
    """(estimate, low, high)."""
    why: tuple[str, str] = ("", "")
    """What the low and the high bound assume."""
    exact: bool = False

    def to_json(self, prices: Prices | None) -> JSONObject:
        out: JSONObject = {
            "units": self.units, "unit": self.unit, "exact": self.exact,
            "tokens_computed": self.usage.computed_tokens,
            "tokens_computed_interval": [self.low.computed_tokens, self.high.computed_tokens],
            "tokens_without_sharing": self.usage.tokens_without_sharing,
            "tokens_without_sharing_interval": [self.low.tokens_without_sharing,
                                                self.high.tokens_without_sharing],
            **{term: getattr(self.usage, f"{term}_tokens") for term in TERMS},
            "seconds": round(self.seconds[0], 1),
            "seconds_interval": [round(self.seconds[1], 1), round(self.seconds[2], 1)],
            "low_assumes": self.why[0], "high_assumes": self.why[1],
        }
        if prices is not None:
            out["cost"] = round(self.usage.cost(prices).total, 6)
            out["cost_interval"] = [round(self.low.cost(prices).total, 6),
                                    round(self.high.cost(prices).total, 6)]
        return out


def exact_part(name: str, label: str, units: int, unit: str, samples: Sequence[Unit],
               load: tuple[float, float]) -> Part:
    """A part the pilot ran in full: its tokens as they were; its seconds as they were,
    between the load's bounds."""
    usage = Usage.total(u.usage for u in samples)
    seconds = sum(u.seconds for u in samples)
    why = "the pilot ran this part in full; seconds at "
    return Part(name, label, units, unit, usage, usage, usage,
                (seconds, seconds * load[0], seconds * load[1]),
                (why + "the machine to itself", why + _load_text()), True)


def _load_text() -> str:
    return "the highest load average allowed (--max-load)"


def _with_totals(usage: Usage, computed: float, without_sharing: float) -> Usage:
    """`usage` with its computed terms scaled to `computed` in all, and what sharing
    saved set so that its tokens before sharing are `without_sharing`."""
    out = scaled(usage, computed / usage.computed_tokens) if usage.computed_tokens else usage
    saved = round(without_sharing) - out.computed_tokens - out.prefill_cached_tokens
    return out.model_copy(update={"train_shared_tokens": max(saved, 0)})


def _stages(config: TrainConfig, n: int) -> list[tuple[int, int]]:
    """(pilot steps, run steps) per warm-start stage, for a pilot of `n` steps whose
    stages were scaled from the run's as `pilot_config` does; one pair otherwise."""
    stages = [int(s["steps"]) for s in config.sft_stages]
    pilot = [max(1, round(s * n / config.sft_steps)) for s in stages]
    if not stages or sum(pilot) != n or sum(stages) != config.sft_steps:
        return [(n, config.sft_steps)]
    return list(zip(pilot, stages))


def warm_start_part(config: TrainConfig, samples: Sequence[Unit],
                    load: tuple[float, float]) -> Part:
    """The warm start, stage by stage: sampled totals of the pilot's steps' tokens
    computed, tokens before sharing and seconds."""
    label, units = f"warm start ({config.sft_steps} steps)", config.sft_steps
    if len(samples) >= units:
        return exact_part("warm_start", label, units, "step", samples[:units], load)
    computed, billed, seconds, usage = [0.0] * 3, [0.0] * 3, [0.0] * 3, Usage()
    start = 0
    for n, run in _stages(config, len(samples)):
        stage = samples[start:start + n]
        start += n
        usage = usage + scaled(Usage.total(u.usage for u in stage), run / n)
        for acc, values in ((computed, [u.usage.computed_tokens for u in stage]),
                            (billed, [u.usage.tokens_without_sharing for u in stage]),
                            (seconds, [u.seconds for u in stage])):
            for i, v in enumerate(sampled_total(values, run)):
                acc[i] += v
    why = (f"the run's steps as the pilot's {len(samples)} sampled them (their episodes "
           f"are the expert's, whatever the weights), {Z:g} standard errors below; "
           "seconds alone on the machine",
           f"{Z:g} standard errors above; seconds at {_load_text()}")
    return Part("warm_start", label, units, "step", usage,
                _with_totals(usage, computed[1], billed[1]),
                _with_totals(usage, computed[2], billed[2]),
                (seconds[0], seconds[1] * load[0], seconds[2] * load[1]), why)


def policy_part(name: str, label: str, units: int, unit: str, samples: Sequence[Unit],
                low_unit: Usage, high_unit: Usage, why: tuple[str, str],
                load: tuple[float, float]) -> Part:
    """A part whose episodes the policy plays: `low_unit` and `high_unit` a unit's
    bounds, the estimate halfway; seconds the pilot's mean unit's, its passes' in
    proportion to their tokens (`Unit.seconds_for`)."""
    mean = mean_unit(samples)
    low, high = scaled(low_unit, units), scaled(high_unit, units)
    usage = midpoint(low, high)
    return Part(name, label, units, unit, usage, low, high, (
        units * mean.seconds_for(midpoint(low_unit, high_unit)),
        units * mean.seconds_for(low_unit) * load[0],
        units * mean.seconds_for(high_unit) * load[1]), why)


def _volume(ratio: float, which: str) -> str:
    return (f"episodes as the pilot's {which} GRPO group played them ({ratio:.2f}x its "
            "mean, before sharing)")


def grpo_part(config: TrainConfig, label: str, samples: Sequence[Unit],
              records: Sequence[JSONObject], shape: Shape, load: tuple[float, float]) -> Part:
    """GRPO from the pilot's steps: between a policy that plays like the pilot's
    cheapest group and shares all it can (entropy zero), and one that plays like its
    dearest group, shares as the pilot's did and trains every group."""
    mean = mean_unit(samples).usage
    skipped = sum(float(r.get("groups/skipped", 0.0)) for r in records) / len(records)
    low = scaled(collapsed(mean, shape.first_turn_prefill, config.group_size),
                 shape.volume_low)
    high = scaled(all_groups_trained(mean, skipped, config.groups_per_step),
                  shape.volume_high)
    why = (f"{_volume(shape.volume_low, 'cheapest')}; the policy's entropy zero, a group's "
           f"{config.group_size} samples computing their later prompts and training "
           "positions once; seconds alone on the machine",
           f"{_volume(shape.volume_high, 'dearest')}; shared as the pilot's policy did, "
           f"every group trained (the pilot skipped {skipped:.1f} of "
           f"{config.groups_per_step} a step); seconds at {_load_text()}")
    return policy_part("grpo", label, config.steps, "step", samples, low, high, why, load)


def eval_part(config: TrainConfig, label: str, units: int, samples: Sequence[Unit],
              same: int, shape: Shape, load: tuple[float, float]) -> Part:
    """The evaluations from the pilot's. The run's first `same` evaluate the weights the
    pilot's first `same` did (before training; after a warm start the pilot ran in
    full): theirs. The others from the pilot's later ones: their volume as GRPO's groups
    bound it (one policy plays both); at entropy zero, every `group_size` episodes
    computing as one after their first turns; at most shared as the pilot's."""
    known = Usage.total(u.usage for u in samples[:same])
    known_s = sum(u.seconds for u in samples[:same])
    why_known = f"the first {same} as the pilot's (the same weights)" if same else ""
    if units <= same:
        return Part("eval", label, units, "evaluation", known, known, known,
                    (known_s, known_s * load[0], known_s * load[1]),
                    (why_known + "; seconds alone on the machine",
                     why_known + f"; seconds at {_load_text()}"))
    later = samples[same:] or samples
    mean = mean_unit(later).usage
    first = shape.eval_first_turn_share * mean.prefill_computed_tokens
    low = scaled(collapsed(mean, first, config.group_size), shape.volume_low)
    why = (f"{_volume(shape.volume_low, 'cheapest')}; the policy's entropy zero, every "
           f"{config.group_size} episodes computing as one after their first turn; "
           "seconds alone on the machine", f"{_volume(shape.volume_high, 'dearest')}; "
           f"shared as the pilot's policy did; seconds at {_load_text()}")
    rest = policy_part("eval", label, units - same, "evaluation", later, low,
                       scaled(mean, shape.volume_high), why, load)
    if not same:
        return replace(rest, units=units)
    return Part("eval", label, units, "evaluation", known + rest.usage, known + rest.low,
                known + rest.high, (known_s + rest.seconds[0],
                                    known_s * load[0] + rest.seconds[1],
                                    known_s * load[1] + rest.seconds[2]),
                (f"{why_known}; the rest: {why[0]}", f"{why_known}; the rest: {why[1]}"))
