"""What a run will cost, from a short pilot of it: tokens, seconds and money per part.

1) `pilot_config`: the run cut short (a few warm-start and GRPO steps, one evaluation
   batch per evaluation), which `prefixgym estimate` runs like any other.
2) `extrapolate`: per part of the run (warm start, GRPO, evaluations) the pilot's mean
   per unit (a step; an evaluation episode) times the units the configured run has,
   with the pilot's cheapest and dearest unit scaled alike as the interval; the rest
   of the wall time (start-up, checkpoints, the report) as the pilot's.
3) `Estimate.to_json`: estimate.json; `Estimate.table`: what the command prints.
The assumptions each part rests on are in `ASSUMPTIONS` and printed with it. Knows
metrics records, the config and prices; nothing of engines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from prefixgym.pricing import Prices, money
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.evaluate import EVAL_WIDTH
from prefixgym.trainer.report import usage_of
from prefixgym.types import JSONObject, Usage

PILOT_SFT_STEPS = 20
PILOT_GRPO_STEPS = 4
PILOT_EVAL_EPISODES = 2 * EVAL_WIDTH
"""Two evaluation batches: the first computes the prompts every later one finds cached
(its episodes' first prompts are often one and the same, each prefilled in its round),
so a run's evaluation costs the first batch plus the later ones at the second's rate."""
TRACE = "trace.jsonl"
"""The pilot's trace in its directory: where the evaluations' batches are told apart."""
TERMS = ("prefill_computed", "prefill_cached", "sampled", "train_computed", "train_shared")
ASSUMPTIONS = (
    "warm start: every step costs what the pilot's did on average (its episodes are the "
    "expert's, whatever the weights: this part is the most exact)",
    "GRPO: every step costs what the pilot's first steps did. The tokens it processes "
    "(without sharing) hold steady, but a policy that sharpens samples more alike within "
    "a group, and the cache and training then compute fewer of them (on the default run "
    "step 59 computed 54% of step 0's): tokens computed err high the more GRPO learns, "
    "and so do the later evaluations' tokens computed",
    "the pilot's warm start is short, so its GRPO and evaluation episodes come from a "
    "policy less trained than the run's: their lengths and turns may differ",
    "evaluations: each costs its first batch of episodes as the pilot's did, and every "
    "later episode what the pilot's second batch did per episode; the same at every "
    "evaluation of the run",
    "seconds: as on this machine now, under its current load; the rest of the wall time "
    "(start-up, checkpoints, the report) as in the pilot",
)


def pilot_config(config: TrainConfig, out: str, sft_steps: int | None = PILOT_SFT_STEPS,
                 steps: int = PILOT_GRPO_STEPS) -> TrainConfig:
    """The run of `config` cut to a pilot in `out`: at most `sft_steps` warm-start steps
    (None: all of them; its stages scaled down alike) on the run's learning-rate
    schedule compressed to them, at most `steps` GRPO steps, one evaluation batch per
    evaluation, and no evaluation or checkpoint in between."""
    sft = config.sft_steps if sft_steps is None else min(config.sft_steps, sft_steps)
    stages = config.sft_stages
    if stages:
        counts = [max(1, round(int(s["steps"]) * sft / config.sft_steps)) for s in stages]
        stages = [{**s, "steps": n} for s, n in zip(stages, counts)]
        sft = sum(counts)
    steps = min(config.steps, steps)
    return replace(config, out=out, sft_steps=sft, sft_stages=stages, steps=steps,
                   eval_episodes=min(config.eval_episodes, PILOT_EVAL_EPISODES),
                   eval_every=max(steps, 1), checkpoint_every=max(steps, 1),
                   resume=False, force_resume=False, trace=str(Path(out) / TRACE), tracker="")


def evaluations_in(config: TrainConfig) -> int:
    """How many evaluations the run of `config` makes (`Run`: before training when asked,
    after the warm start, every `eval_every` GRPO steps and after the last)."""
    grpo = sum(1 for s in range(1, config.steps + 1)
               if s % config.eval_every == 0 or s == config.steps)
    return int(bool(config.eval_on_start)) + int(config.sft_steps > 0) + grpo


@dataclass(frozen=True)
class Part:
    """One part of the run: `units` of `unit` at the pilot's mean usage and seconds per
    unit; the interval scales the pilot's cheapest and dearest unit alike."""

    name: str
    label: str
    units: int
    unit: str
    usage: Usage
    low: Usage
    high: Usage
    seconds: tuple[float, float, float]
    """(estimate, low, high)."""

    def to_json(self, prices: Prices | None) -> JSONObject:
        out: JSONObject = {
            "units": self.units, "unit": self.unit,
            "tokens_computed": self.usage.computed_tokens,
            "tokens_computed_interval": [self.low.computed_tokens, self.high.computed_tokens],
            "tokens_without_sharing": self.usage.tokens_without_sharing,
            **{term: getattr(self.usage, f"{term}_tokens") for term in TERMS},
            "seconds": round(self.seconds[0], 1),
            "seconds_interval": [round(self.seconds[1], 1), round(self.seconds[2], 1)],
        }
        if prices is not None:
            out["cost"] = round(self.usage.cost(prices).total, 6)
            out["cost_interval"] = [round(self.low.cost(prices).total, 6),
                                    round(self.high.cost(prices).total, 6)]
        return out


def _scaled(usage: Usage, factor: float) -> Usage:
    return Usage(**{k: round(getattr(usage, k) * factor) for k in Usage.model_fields})


def _part(name: str, label: str, units: int, unit: str, samples: Sequence[tuple[Usage, float]],
          ) -> Part:
    """`samples`: (usage, seconds) of one pilot unit each."""
    n = len(samples)
    mean = Usage.total(u for u, _ in samples)
    cheapest = min(samples, key=lambda s: s[0].computed_tokens)[0]
    dearest = max(samples, key=lambda s: s[0].computed_tokens)[0]
    seconds = [s for _, s in samples]
    return Part(name, label, units, unit, _scaled(mean, units / n), _scaled(cheapest, units),
                _scaled(dearest, units),
                (sum(seconds) / n * units, min(seconds) * units, max(seconds) * units))


def eval_batches(trace: Sequence[JSONObject]) -> dict[int, list[Usage]]:
    """Each evaluation's usage per batch of `EVAL_WIDTH` episodes, from a run's trace
    (its episodes' group ids are `eval<k>/<episode>`)."""
    batches: dict[int, dict[int, Usage]] = {}
    for line in trace:
        group = str(line.get("group_id") or "")
        head, _, episode = group.partition("/")
        if not (head.startswith("eval") and head[4:].isdigit() and episode.isdigit()):
            continue
        per = batches.setdefault(int(head[4:]), {})
        b = int(episode) // EVAL_WIDTH
        per[b] = per.get(b, Usage()) + Usage(**{k: v for k, v in line.get("usage", {}).items()
                                                if k in Usage.model_fields})
    return {k: [per[b] for b in sorted(per)] for k, per in sorted(batches.items())}


def _evaluation(config: TrainConfig, record: JSONObject, batches: list[Usage] | None,
                ) -> tuple[Usage, float]:
    """One evaluation of the run (its `eval_episodes`) from one of the pilot's: its first
    batch as it was, each later episode at the second batch's rate (the pilot's rate
    per episode without a trace)."""
    played, episodes = int(record["eval/episodes"]), config.eval_episodes
    seconds = float(record["time/eval_s"]) / played * episodes
    if not batches:
        return _scaled(usage_of(record), episodes / played), seconds
    first = min(episodes, EVAL_WIDTH)
    if len(batches) < 2 or episodes <= first:
        return _scaled(batches[0], first / min(played, EVAL_WIDTH)), seconds
    second = played - EVAL_WIDTH
    return batches[0] + _scaled(batches[1], (episodes - first) / second), seconds


def extrapolate(config: TrainConfig, records: Sequence[JSONObject],
                trace: Sequence[JSONObject] = ()) -> list[Part]:
    """The parts of the run of `config` from the metrics `records` of its pilot (and
    its trace, which tells an evaluation's batches apart)."""
    def of(phase: str) -> list[JSONObject]:
        return [r for r in records if r.get("phase") == phase]

    parts = []
    sft, grpo, evals = of("sft"), of("grpo"), of("eval")
    if config.sft_steps and sft:
        parts.append(_part("warm_start", f"warm start ({config.sft_steps} steps)",
                           config.sft_steps, "step",
                           [(usage_of(r), float(r["time/step_s"])) for r in sft]))
    if config.steps and grpo:
        parts.append(_part("grpo", f"GRPO ({config.steps} steps)", config.steps, "step",
                           [(usage_of(r), float(r["time/step_s"])) for r in grpo]))
    n_evals = evaluations_in(config)
    by_batch = eval_batches(trace)
    played = [(i, r) for i, r in enumerate(evals) if r.get("eval/episodes")]
    if n_evals and played:
        parts.append(_part("eval", f"evaluations ({n_evals} x {config.eval_episodes} "
                           "episodes)", n_evals, "evaluation",
                           [_evaluation(config, r, by_batch.get(i)) for i, r in played]))
    return parts


@dataclass(frozen=True)
class Estimate:
    config: TrainConfig
    parts: list[Part]
    rest_s: float
    """The pilot's wall time outside its parts: start-up, checkpoints, the report."""
    pilot: JSONObject
    prices: Prices | None = None
    price_note: str = ""

    def total(self, pick: Callable[[Part], Usage]) -> Usage:
        return Usage.total(pick(p) for p in self.parts)

    @property
    def seconds(self) -> list[float]:
        """The whole run's (estimate, low, high): the parts' and the rest."""
        return [sum(p.seconds[i] for p in self.parts) + self.rest_s for i in range(3)]

    def to_json(self) -> JSONObject:
        seconds = self.seconds
        usage = self.total(lambda p: p.usage)
        total: JSONObject = {
            "tokens_computed": usage.computed_tokens,
            "tokens_computed_interval": [self.total(lambda p: p.low).computed_tokens,
                                         self.total(lambda p: p.high).computed_tokens],
            "tokens_without_sharing": usage.tokens_without_sharing,
            "seconds": round(seconds[0], 1),
            "seconds_interval": [round(seconds[1], 1), round(seconds[2], 1)],
        }
        if self.prices is not None:
            total["cost"] = round(usage.cost(self.prices).total, 6)
        out: JSONObject = {
            "parts": {p.name: p.to_json(self.prices) for p in self.parts},
            "rest_seconds": round(self.rest_s, 1), "total": total, "pilot": self.pilot,
            "assumptions": list(ASSUMPTIONS),
        }
        if self.prices is not None:
            out["prices"] = {"model": self.prices.model, "currency": self.prices.currency,
                             "source": self.prices.source, "why": self.price_note}
        return out

    def table(self) -> str:
        """The estimate as aligned text: one row per part, then the whole run."""
        cur = self.prices.currency if self.prices else "USD"

        def row(label: str, usage: Usage, low: Usage, high: Usage,
                seconds: Sequence[float]) -> list[str]:
            cells = [label, f"{usage.tokens_without_sharing:,}", f"{usage.computed_tokens:,}",
                     f"{low.computed_tokens:,}-{high.computed_tokens:,}",
                     *(f"{getattr(usage, f'{t}_tokens'):,}" for t in TERMS[:4]),
                     f"{seconds[0]:,.0f} ({seconds[1]:,.0f}-{seconds[2]:,.0f})"]
            if self.prices is not None:
                cells.append(money(usage.cost(self.prices).total, cur))
            return cells

        head = ["part", "without sharing", "tokens computed", "interval", "prefill computed",
                "prefill cached",
                "sampled", "train computed", "seconds (interval)"]
        if self.prices is not None:
            head.append("cost")
        rows = [head] + [row(p.label, p.usage, p.low, p.high, p.seconds) for p in self.parts]
        rest = ["the rest (start-up, checkpoints, report)", *[""] * 7, f"{self.rest_s:,.0f}"]
        rows.append(rest + ([""] if self.prices is not None else []))
        rows.append(row("whole run", self.total(lambda p: p.usage), self.total(lambda p: p.low),
                        self.total(lambda p: p.high), self.seconds))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
        return "\n".join(lines)
