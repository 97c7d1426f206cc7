"""The parts of a run's estimate (warm start, GRPO, evaluations), each an estimate
between a low and a high bound (`estimate_bounds` draws them), with what each bound
assumes in words.

`exact_part`: a part the pilot ran in full. `warm_start_part`: sampled totals, stage
by stage. `grpo_part`, `eval_part`: between a converged policy on the shorter episodes
and the pilot's sharing on the longer, the estimate halfway (`policy_part`), seconds in
proportion to each pass's tokens. Knows `Usage`, metrics records and the config;
nothing of engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from prefixgym.pricing import Prices
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.estimate_bounds import (
    LENGTH_SLACK,
    Shape,
    Unit,
    Z,
    all_groups_trained,
    converged,
    lengthened,
    mean_unit,
    midpoint,
    sampled_total,
    scaled,
)
from prefixgym.types import JSONObject, Usage

TERMS = ("prefill_computed", "prefill_cached", "sampled", "train_computed", "train_shared")


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


def stages(config: TrainConfig, n: int) -> list[tuple[int, int]]:
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
    for n, run in stages(config, len(samples)):
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


def _lengths(shape: Shape) -> tuple[str, str]:
    slack = f"{LENGTH_SLACK:.0%}"
    return (f"episodes {shape.length_low:.2f}x the pilot's long (the shorter of its "
            f"policy's and the experts', less {slack})",
            f"episodes {shape.length_high:.2f}x the pilot's long (the longer of its "
            f"policy's and the experts', plus {slack})")


def grpo_part(config: TrainConfig, label: str, samples: Sequence[Unit],
              records: Sequence[JSONObject], shape: Shape, load: tuple[float, float]) -> Part:
    """GRPO from the pilot's steps: between a converged policy (entropy zero: nothing
    trained, each group's later prompts computed once) playing the shorter episodes,
    and one that shares as the pilot's did, trains every group and plays the longer."""
    mean = mean_unit(samples).usage
    skipped = sum(float(r.get("groups/skipped", 0.0)) for r in records) / len(records)
    low = converged(mean, shape.first_turn_prefill, config.group_size, shape.length_low)
    high = lengthened(all_groups_trained(mean, skipped, config.groups_per_step),
                      shape.length_high)
    short, long = _lengths(shape)
    why = (f"{short}; the policy's entropy zero: a group's {config.group_size} samples "
           "alike, their later prompts computed once, their rewards equal so nothing "
           "trained; seconds alone on the machine",
           f"{long}; shared as the pilot's policy did, every group trained (the pilot "
           f"skipped {skipped:.1f} of {config.groups_per_step} a step); seconds at "
           f"{_load_text()}")
    return policy_part("grpo", label, config.steps, "step", samples, low, high, why, load)


def eval_part(config: TrainConfig, label: str, units: int, samples: Sequence[Unit],
              same: int, shape: Shape, load: tuple[float, float]) -> Part:
    """The evaluations from the pilot's. The run's first `same` evaluate the weights the
    pilot's first `same` did (before training; after a warm start the pilot ran in
    full): theirs. The others from the pilot's later ones, between a converged policy
    (every `group_size` episodes computing as one after their first turns) playing the
    shorter episodes and the pilot's sharing on the longer."""
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
    low = converged(mean, first, config.group_size, shape.length_low)
    short, long = _lengths(shape)
    why = (f"{short}; the policy's entropy zero, every {config.group_size} episodes "
           "computing as one after their first turn; seconds alone on the machine",
           f"{long}; shared as the pilot's policy did; seconds at {_load_text()}")
    rest = policy_part("eval", label, units - same, "evaluation", later, low,
                       lengthened(mean, shape.length_high), why, load)
    if not same:
        return replace(rest, units=units)
    return Part("eval", label, units, "evaluation", known + rest.usage, known + rest.low,
                known + rest.high, (known_s + rest.seconds[0],
                                    known_s * load[0] + rest.seconds[1],
                                    known_s * load[1] + rest.seconds[2]),
                (f"{why_known}; the rest: {why[0]}", f"{why_known}; the rest: {why[1]}"))
