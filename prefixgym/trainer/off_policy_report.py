"""report.md's sections on off-policy samples: the sampler/trainer mismatch on the
trained tokens (`versions.logprob_mismatch`'s metrics) and the staleness histogram
(`versions.keep_on_policy`'s), each over the run's GRPO steps. Knows metric names;
not how they were produced.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixgym.types import JSONObject

MISMATCH_ROWS = (
    ("sampler/mean_logprob_gap", "mean abs logprob gap"),
    ("sampler/max_logprob_gap", "max abs logprob gap"),
    ("sampler/kl_k3", "KL(sampler \\|\\| trainer), k3"),
    ("off_policy/weight_mean", "importance weight, mean"),
    ("off_policy/capped_fraction", "tokens capped (tis)"),
    ("off_policy/masked_fraction", "tokens masked (mis)"),
    ("loss/clip_fraction", "tokens the loss's clip held (ppo, gspo, cispo)"),
)


def mismatch_lines(records: Sequence[JSONObject]) -> list[str]:
    """The sampler/trainer mismatch on the trained tokens over the GRPO steps that trained
    (none: no lines): each metric's mean over the steps, its largest and its last."""
    steps = [r for r in records if r.get("phase") == "grpo" and "sampler/kl_k3" in r]
    if not steps:
        return []
    rows = ["| per GRPO step | mean | largest | last step |", "|---|---:|---:|---:|"]
    for key, name in MISMATCH_ROWS:
        values = [float(r[key]) for r in steps if key in r]
        if values:
            rows.append(f"| {name} | {sum(values) / len(values):.3g} | {max(values):.3g} | "
                        f"{values[-1]:.3g} |")
    return ["## Sampler / trainer mismatch", "",
            f"Over the trained tokens of {len(steps)} GRPO steps: the sampler's logprobs "
            "against the trainer's before its update (mismatch.png; docs/scaling.md says "
            "what they mean).", "", *rows, ""]


def staleness_lines(records: Sequence[JSONObject]) -> list[str]:
    """How many versions old the trained samples were (--max-staleness, --async): the
    run's histogram, episodes per lag, and those dropped as older than K (none: a
    synchronous run's, all at lag 0)."""
    steps = [r for r in records if r.get("phase") == "grpo" and "sampler/version_lag" in r]
    by_lag: dict[int, float] = {}
    for r in steps:
        for key, value in r.items():
            if key.startswith("staleness/"):
                lag = int(key.split("/", 1)[1])
                by_lag[lag] = by_lag.get(lag, 0.0) + float(value)
    stale = sum(float(r.get("episodes/stale", 0.0)) for r in steps)
    if not stale and set(by_lag) <= {0}:
        return []
    rows = ["| versions behind the trainer | episodes trained |", "|---:|---:|",
            *(f"| {lag} | {by_lag[lag]:.0f} |" for lag in sorted(by_lag))]
    return ["## Staleness", "",
            f"The weights each trained episode was sampled from, in versions behind the "
            f"trainer's, over {len(steps)} GRPO steps; {stale:.0f} episodes were dropped as "
            "older than --max-staleness.", "", *rows, ""]
