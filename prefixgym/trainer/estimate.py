"""What a run will cost, from a short pilot of it: tokens, seconds and money per part,
each a low and a high bound with the assumption behind each, the estimate between.

1) `pilot_config`: the run cut short (a few warm-start and GRPO steps, one evaluation
   batch per evaluation), which `prefixgym estimate` runs like any other.
2) `extrapolate`: per part of the run (warm start, GRPO, evaluations), from the
   pilot's units (a step; an evaluation: its first batch, then the second's rate) and
   its trace, the tokens before sharing (what the hosted service bills), the tokens
   computed and the seconds, each as (estimate, low, high); `estimate_bounds` says
   how each bound is drawn. A part the pilot ran in full is exact.
3) `Estimate.to_json`: estimate.json; `Estimate.table`: what the command prints.
Knows metrics records, trace lines, the config and prices; nothing of engines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from prefixgym.pricing import Prices, money
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.estimate_bounds import (
    LENGTH_SLACK,
    MAX_LOAD_PER_CORE,
    Unit,
    Z,
    expert_length,
    grpo_length,
    scaled,
    shape_of,
)
from prefixgym.trainer.estimate_parts import (
    Part,
    eval_part,
    exact_part,
    grpo_part,
    stages,
    warm_start_part,
)
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
ASSUMPTIONS = (
    "a part the pilot ran in full (all its units, from the same weights) is exact; "
    "every other part is a low and a high bound, each with its own assumption, and "
    "the estimate halfway between",
    "warm start: its episodes are the expert's whatever the weights, so the pilot's "
    f"steps are a sample of the run's: {Z:g} standard errors of the total either side",
    "GRPO and evaluations: the policy the run trains is not the pilot's. Its episodes "
    "are as long as the pilot policy's or as the experts' the warm start imitates, or "
    f"between, give or take {LENGTH_SLACK:.0%} (samples and datum positions in "
    "proportion, prompts with the square); it "
    "may share as little as the pilot's policy did and train every group (high), or, "
    "converged to entropy zero, compute each group's later prompts once for its G "
    "samples and train nothing, every group's rewards equal (low)",
    "seconds: the pilot's per unit, in proportion to the bounds of the tokens computed, "
    "from alone on the machine (low) to the load average --max-load (default "
    f"{MAX_LOAD_PER_CORE:g} per core; high), the estimate at the pilot's load; the rest "
    "of the wall time (start-up, checkpoints, the report) as in the pilot's",
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
                ) -> Unit:
    """One evaluation of the run (its `eval_episodes`) from one of the pilot's: its first
    batch as it was, each later episode at the second batch's rate (the pilot's rate
    per episode without a trace)."""
    played, episodes = int(record["eval/episodes"]), config.eval_episodes
    factor = episodes / played  # seconds: at the pilot's rate per episode
    first = min(episodes, EVAL_WIDTH)
    if not batches:
        usage = scaled(usage_of(record), factor)
    elif len(batches) < 2 or episodes <= first:
        usage = scaled(batches[0], first / min(played, EVAL_WIDTH))
    else:
        usage = batches[0] + scaled(batches[1], (episodes - first) / (played - EVAL_WIDTH))
    return Unit.of(record, usage, factor)



def extrapolate(config: TrainConfig, records: Sequence[JSONObject],
                trace: Sequence[JSONObject] = (), load: tuple[float, float] = (1.0, 1.0),
                ) -> list[Part]:
    """The parts of the run of `config` from the metrics `records` of its pilot, its
    trace (an evaluation's batches, the GRPO groups' spread and first turns) and `load`
    (`estimate_bounds.load_factors`: how much faster and slower than the pilot's the
    run's seconds may be)."""
    def of(phase: str) -> list[JSONObject]:
        return [r for r in records if r.get("phase") == phase]

    parts = []
    sft, grpo, evals = of("sft"), of("grpo"), of("eval")
    experts, start = [], 0
    for n, _ in stages(config, len(sft)) if sft else []:
        experts.append(expert_length(sft[start:start + n], config.sft_episodes_per_step))
        start += n
    shape = shape_of(trace, grpo_length(grpo, config.groups_per_step, config.group_size),
                     experts)
    # GRPO (and every evaluation) exact only from the run's own weights and steps
    grpo_in_full = len(sft) >= config.sft_steps and len(grpo) >= config.steps
    if config.sft_steps and sft:
        parts.append(warm_start_part(
            config, [Unit.of(r) for r in sft], load))
    if config.steps and grpo:
        label, samples = f"GRPO ({config.steps} steps)", [
            Unit.of(r) for r in grpo]
        parts.append(exact_part("grpo", label, config.steps, "step", samples, load)
                     if grpo_in_full else grpo_part(config, label, samples, grpo, shape, load))
    n_evals = evaluations_in(config)
    by_batch = eval_batches(trace)
    played = [(i, r) for i, r in enumerate(evals) if r.get("eval/episodes")]
    if n_evals and played:
        label = f"evaluations ({n_evals} x {config.eval_episodes} episodes)"
        samples = [_evaluation(config, r, by_batch.get(i)) for i, r in played]
        if (grpo_in_full and len(played) == n_evals
                and config.eval_episodes <= PILOT_EVAL_EPISODES):
            parts.append(exact_part("eval", label, n_evals, "evaluation", samples, load))
        else:
            same = int(bool(config.eval_on_start)) + int(
                bool(config.sft_steps) and len(sft) >= config.sft_steps)
            parts.append(eval_part(config, label, n_evals, samples, min(same, len(samples)),
                                   shape, load))
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
    load: tuple[float, float] = (1.0, 1.0)
    """How much faster (alone on the machine) and slower than the pilot the run may be."""

    def total(self, pick: Callable[[Part], Usage]) -> Usage:
        return Usage.total(pick(p) for p in self.parts)

    @property
    def seconds(self) -> list[float]:
        """The whole run's (estimate, low, high): the parts' and the rest."""
        rest = (self.rest_s, self.rest_s * self.load[0], self.rest_s * self.load[1])
        return [sum(p.seconds[i] for p in self.parts) + rest[i] for i in range(3)]

    def to_json(self) -> JSONObject:
        seconds = self.seconds
        usage, low, high = (self.total(lambda p: p.usage), self.total(lambda p: p.low),
                            self.total(lambda p: p.high))
        total: JSONObject = {
            "tokens_computed": usage.computed_tokens,
            "tokens_computed_interval": [low.computed_tokens, high.computed_tokens],
            "tokens_without_sharing": usage.tokens_without_sharing,
            "tokens_without_sharing_interval": [low.tokens_without_sharing,
                                                high.tokens_without_sharing],
            "seconds": round(seconds[0], 1),
            "seconds_interval": [round(seconds[1], 1), round(seconds[2], 1)],
        }
        if self.prices is not None:
            total["cost"] = round(usage.cost(self.prices).total, 6)
            total["cost_interval"] = [round(low.cost(self.prices).total, 6),
                                      round(high.cost(self.prices).total, 6)]
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
        """The estimate as aligned text: per part, its tokens before sharing (what the
        hosted service bills), tokens computed, seconds (and money), each low, estimate
        and high with its width; what each bound assumes; then the whole run."""
        cur = self.prices.currency if self.prices else "USD"

        def rows(label: str, usage: Usage, low: Usage, high: Usage,
                 seconds: Sequence[float]) -> list[list[str]]:
            figures: list[tuple[str, float, float, float]] = [
                ("before sharing (billed)", low.tokens_without_sharing,
                 usage.tokens_without_sharing, high.tokens_without_sharing),
                ("tokens computed", low.computed_tokens, usage.computed_tokens,
                 high.computed_tokens),
                ("seconds", seconds[1], seconds[0], seconds[2])]
            out = [[label if i == 0 else "", what, f"{lo:,.0f}", f"{mid:,.0f}", f"{hi:,.0f}",
                    _width(lo, mid, hi)] for i, (what, lo, mid, hi) in enumerate(figures)]
            if self.prices is not None:
                money_of = [u.cost(self.prices).total for u in (low, usage, high)]
                out.append(["", "cost", *(money(m, cur) for m in money_of),
                            _width(money_of[0], money_of[1], money_of[2])])
            return out

        table = [["part", "", "low", "estimate", "high", "width"]]
        notes: list[str] = []
        for p in self.parts:
            table += rows(p.label, p.usage, p.low, p.high, p.seconds)
            notes += [f"{p.label}, low: {p.why[0]}", f"{p.label}, high: {p.why[1]}"]
        table.append(["the rest (start-up, checkpoints, report)", "seconds",
                      f"{self.rest_s * self.load[0]:,.0f}", f"{self.rest_s:,.0f}",
                      f"{self.rest_s * self.load[1]:,.0f}", ""])
        table += rows("whole run", self.total(lambda p: p.usage),
                      self.total(lambda p: p.low), self.total(lambda p: p.high), self.seconds)
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in table]
        return "\n".join(lines + [""] + [f"- {n}" for n in notes])


def _width(low: float, mid: float, high: float) -> str:
    """The interval as +-% of the estimate (its larger side)."""
    if mid <= 0:
        return ""
    return f"+-{max(high - mid, mid - low) / mid:.0%}"
