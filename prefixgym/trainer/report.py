"""What a run leaves behind: metrics.jsonl and report.md (the plots are plots.py's).

`report.md` lists the whole run's tokens per phase, as the source document asks:
prefill computed and cached, sampled, train computed and shared and train loss tokens,
and what prefill and training would have computed without the cache and without shared
prefixes; their money per phase at a price table's rates (`pricing`). Knows metric
dicts and `Usage`; not how they were produced.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from prefixgym.files import write_text_atomically
from prefixgym.pricing import Prices, money
from prefixgym.trainer.off_policy_report import mismatch_lines, staleness_lines
from prefixgym.trainer.tracking import Tracker
from prefixgym.types import JSONObject, Usage

PHASE_FIELDS = {
    "tokens/prefill_computed": "prefill_computed_tokens",
    "tokens/prefill_cached": "prefill_cached_tokens",
    "tokens/sampled": "sampled_tokens",
    "tokens/train_computed": "train_computed_tokens",
    "tokens/train_loss": "train_loss_tokens",
    "tokens/train_shared": "train_shared_tokens",
}
"""metrics.jsonl's per-phase token counts (docs/files.md) and the `Usage` field of each."""


def phase_metrics(usage: Usage) -> dict[str, float]:
    """The per-phase token counts of `usage` under their metrics.jsonl names, and the
    prefix-cache hit rate."""
    return {**{key: float(getattr(usage, name)) for key, name in PHASE_FIELDS.items()},
            "cache/hit_rate": usage.cache_hit_rate}


def usage_of(record: JSONObject) -> Usage:
    """The tokens a metrics record counts (`phase_metrics` read back; 0 where absent)."""
    return Usage(**{name: int(record.get(key, 0)) for key, name in PHASE_FIELDS.items()})


class MetricsLog:
    """Append-only metrics.jsonl; `truncate_after(step)` makes a resumed run exact.

    A process killed mid-write can leave a partial last line: `read` drops it (and
    `truncate_after` rewrites the file without it); a bad line anywhere else is a
    ValueError naming the file and line. The log is never deleted: a run that starts
    over moves it aside (`set_aside`).
    Each line also goes to `tracker` when one is given (`tracking.py`), and both cuts
    (`truncate_after`, `set_aside`) are made there too (`Tracker.rewind`)."""

    def __init__(self, path: Path, tracker: Tracker | None = None) -> None:
        self.path = path
        self.tracker = tracker

    def write(self, record: JSONObject) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tracker is not None:
            self.tracker.log(record)

    def read(self) -> list[JSONObject]:
        if not self.path.exists():
            return []
        lines = self.path.read_text().split("\n")  # the last item: after the last newline
        records: list[JSONObject] = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                if number == len(lines):  # no newline after it: a write cut short
                    break
                raise ValueError(f"{self.path}:{number}: not a JSON line ({e})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{self.path}:{number}: not a JSON object")
            records.append(record)
        return records

    def set_aside(self) -> Path | None:
        """Rename an existing log to metrics.N.jsonl (the first free N); its new name."""
        if not self.path.exists():
            return None
        n = 1
        while (aside := self.path.with_name(f"{self.path.stem}.{n}{self.path.suffix}")).exists():
            n += 1
        self.path.rename(aside)
        if self.tracker is not None:  # the earlier run's points leave the tracker's view
            self.tracker.rewind(0, [])
        return aside

    def truncate_in_warm_start(self, sft_step: int) -> None:
        """Drop what a run logged after the checkpoint of warm-start step `sft_step` was
        saved: what stays is the first evaluation and the warm start's lines to there."""
        kept = [r for r in self.read()
                if (r.get("phase") == "sft" and r["sft_step"] <= sft_step)
                or (r.get("phase") == "eval" and r.get("when") == "before training")]
        self._keep(sft_step + 1, kept)

    def truncate_after(self, step: int) -> None:
        """Drop what a run logged after the checkpoint of GRPO step `step` was saved
        (step -1: the warm start's checkpoint, which follows the warm start's lines)."""
        # an eval at step+1 ran on the checkpoint's weights, before it was saved
        kept = [r for r in self.read()
                if r.get("step", -1) <= step or r.get("phase") == "sft"
                or (r.get("phase") == "eval" and r["step"] <= step + 1)]
        self._keep(step + 1, kept)

    def _keep(self, first_dropped: int, kept: list[JSONObject]) -> None:
        write_text_atomically(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        if self.tracker is not None:  # the same cut there (tracking.py)
            self.tracker.rewind(first_dropped, kept)


def _fmt(n: float) -> str:
    return f"{int(n):,}"


def phase_table(usage: Usage) -> str:
    without_cache = usage.prefill_tokens
    rows = [
        ("prefill, computed", usage.prefill_computed_tokens),
        ("prefill, served from the prefix cache", usage.prefill_cached_tokens),
        ("sample (decoded tokens)", usage.sampled_tokens),
        ("train, computed (every distinct position of a call)", usage.train_computed_tokens),
        ("train, shared prefix (computed once for several datums)", usage.train_shared_tokens),
        ("train, in the loss (non-zero weight)", usage.train_loss_tokens),
    ]
    lines = ["| phase | tokens |", "|---|---:|"]
    lines += [f"| {name} | {_fmt(v)} |" for name, v in rows]
    lines.append(f"| **computed in all** (prefill + sample + train) | "
                 f"**{_fmt(usage.computed_tokens)}** |")
    lines.append("")
    lines.append(
        f"Without the prefix cache, prefill would have computed {_fmt(without_cache)} tokens "
        f"instead of {_fmt(usage.prefill_computed_tokens)} (cache hit rate "
        f"{usage.cache_hit_rate:.1%})."
    )
    lines.append(
        f"Without shared prefixes, training would have computed {_fmt(usage.train_tokens)} "
        f"tokens instead of {_fmt(usage.train_computed_tokens)}."
    )
    return "\n".join(lines)


def money_table(columns: Sequence[tuple[str, Usage]], prices: Prices, note: str) -> str:
    """Each column's tokens priced per phase at `prices`, with the counterfactuals."""
    costs = [(name, usage.cost(prices)) for name, usage in columns]
    cur = prices.currency
    rows = [("prefill, computed", prices.prefill, lambda c: c.prefill_computed),
            ("prefill, served from the prefix cache", prices.prefill_cached,
             lambda c: c.prefill_cached),
            ("sample", prices.sample, lambda c: c.sample),
            ("train, computed", prices.train, lambda c: c.train)]
    lines = [f"Priced at the rates of {prices.model} ({note}), per million tokens; source: "
             f"{prices.source}.", "",
             "| phase | rate | " + " | ".join(name for name, _ in costs) + " |",
             "|---|---:|" + "---:|" * len(costs)]
    for label, rate, part in rows:
        lines.append(f"| {label} | {money(rate, cur)} | "
                     + " | ".join(money(part(c), cur) for _, c in costs) + " |")
    lines.append("| **total** | | " + " | ".join(f"**{money(c.total, cur)}**" for _, c in costs)
                 + " |")
    for label, part in (("without the prefix cache", lambda c: c.without_cache),
                        ("without shared prefixes in training",
                         lambda c: c.without_shared_prefixes),
                        ("without either", lambda c: c.without_either)):
        lines.append(f"| {label} | | " + " | ".join(money(part(c), cur) for _, c in costs)
                     + " |")
    return "\n".join(lines)


def eval_kind(evals: Sequence[JSONObject]) -> str:
    """How the evaluations sampled: "greedy", or the temperature (runs before the
    option logged none: greedy)."""
    temperature = float(evals[-1].get("eval/temperature", 0.0)) if evals else 0.0
    return "greedy" if temperature == 0 else f"sampled at temperature {temperature:g}"


def eval_table(evals: Sequence[JSONObject]) -> str:
    lines = ["| when | step | success | ± stderr | mean reward | episodes | env errors |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    last_grpo = max((i for i, e in enumerate(evals) if e["when"] == "GRPO"), default=-1)
    for i, e in enumerate(evals):
        when = e["when"] if e["when"] != "GRPO" else (
            "after GRPO" if i == last_grpo else "during GRPO")
        lines.append(
            f"| {when} | {e['step']} | {e['eval/success']:.1%} | "
            f"{e['eval/success_stderr']:.1%} | {e['eval/reward/mean']:.3f} | "
            f"{int(e['eval/episodes'])} | {int(e.get('eval/env_errors', 0))} |"
        )
    errors = [e for e in evals if e.get("eval/env_errors")]
    if errors:
        first = errors[0]
        lines.append(f"\nEnv errors are episodes the env raised in (not failures; success "
                     f"and reward leave them out). The first, at {first['when']}: "
                     f"{first.get('eval/first_error') or 'no message'}")
    return "\n".join(lines)


def improvement_lines(evals: Sequence[JSONObject]) -> list[str]:
    """GRPO's gain over the warm start, with the standard error of the difference."""
    warm = [e for e in evals if e["when"] == "after warm start"]
    grpo = [e for e in evals if e["when"] == "GRPO"]
    if not warm or not grpo:
        return []
    a, b = warm[-1], grpo[-1]
    diff = b["eval/success"] - a["eval/success"]
    se = (a["eval/success_stderr"] ** 2 + b["eval/success_stderr"] ** 2) ** 0.5
    ratio = f" = {diff / se:+.1f} SE" if se else ""
    return [f"GRPO vs the warm start: {100 * diff:+.1f} points of success ± {100 * se:.1f} "
            f"(SE of the difference{ratio}).", ""]


TIME_PHASES = (("prefill", "prefill"), ("decode", "decode"),
               ("forward_backward", "forward_backward"), ("optim_step", "optim_step"),
               ("publish", "publish"), ("env", "env steps"))
"""(`time/<key>_s`, column name): the seconds each record of metrics.jsonl splits out."""
_PARTS = (("warm start", "sft", "time/step_s"), ("GRPO", "grpo", "time/step_s"),
          ("evaluations", "eval", "time/eval_s"))


def seconds_table(records: Sequence[JSONObject], wall_s: float) -> str:
    """Where the wall time went: per part of the run, its wall seconds and those of each
    phase within it (metrics.jsonl's `time/*`), and the rest of the run."""
    head = " | ".join(name for _, name in TIME_PHASES)
    lines = [f"| part of the run | wall | {head} |",
             "|---|---:|" + "---:|" * len(TIME_PHASES)]
    totals = dict.fromkeys([k for k, _ in TIME_PHASES], 0.0)
    accounted = 0.0
    for label, phase, wall_key in _PARTS:
        rows = [r for r in records if r.get("phase") == phase]
        if not rows:
            continue
        wall = sum(float(r.get(wall_key, 0.0)) for r in rows)
        accounted += wall
        cells = []
        for key, _ in TIME_PHASES:
            value = sum(float(r.get(f"time/{key}_s", 0.0)) for r in rows)
            totals[key] += value
            cells.append(f"{value:.1f} s")
        lines.append(f"| {label} | {wall:.1f} s | {' | '.join(cells)} |")
    lines.append(f"| the rest (start-up, checkpoints, report) | {max(wall_s - accounted, 0.0):.1f} s"
                 f" |{' |' * len(TIME_PHASES)}")
    lines.append(f"| **whole run** | **{wall_s:.1f} s** | "
                 + " | ".join(f"{v:.1f} s" for v in totals.values()) + " |")
    lines += ["", "Each phase's seconds are timed where the work runs: the engine's forwards "
              "by kind (prefill, decode), the trainer's calls (forward_backward, optim_step, "
              "publishing the weights to the sampler), the envs' resets and steps (summed over "
              "episodes: concurrent ones overlap). A part's wall time beyond its phases is "
              "Python, scheduling, tokenizing and waiting; with `--async` the next step's "
              "sampling overlaps this step's training, so phases can add up to more than the "
              "wall."]
    return "\n".join(lines)


def branch_lines(records: Sequence[JSONObject]) -> list[str]:
    """An agent program's branches over the run: where it rewrote its history, the calls
    after began a new sequence, prefilled again (none: no lines)."""
    steps = [r for r in records if r.get("phase") == "grpo" and r.get("agent/branches")]
    if not steps:
        return []
    branches = sum(int(r["agent/branches"]) for r in steps)
    tokens = sum(int(r.get("tokens/branch_reprefilled", 0)) for r in steps)
    firsts = [f"- step {r['step']}: {r['agent/first_branch']}" for r in steps
              if r.get("agent/first_branch")][:5]
    return ["## Branches of the agent program", "",
            f"{branches} branches in {len(steps)} GRPO steps: calls whose messages continued "
            f"no earlier reply (the program edited, dropped or reordered its history), "
            f"{tokens:,} prompt tokens prefilled again. The first of each step, up to five:",
            "", *firsts, ""]


def write_report(
    out: Path, title: str, config: JSONObject, total: Usage, sft_usage: Usage,
    evals: Sequence[JSONObject], wall_s: float, numerics: JSONObject | None = None,
    records: Sequence[JSONObject] = (), pricing: tuple[Prices, str] | None = None,
) -> Path:
    eval_usage = Usage.total(usage_of(e) for e in evals)
    grpo_usage = total - sft_usage - eval_usage
    computed = ("" if numerics is None else
                f"Trained in {numerics['compute_dtype']} on {numerics['threads']} threads "
                f"of {numerics['device']}. ")
    parts = [
        f"# {title}",
        "",
        f"Wall time: {wall_s:.0f} s. {computed}Config: `{json.dumps(config, sort_keys=True)}`",
        "",
        f"## Evaluation ({eval_kind(evals)}, held-out seeds)",
        "",
        eval_table(evals) if evals else "No evaluation ran.",
        "",
        *improvement_lines(evals),
        *branch_lines(records),
        *mismatch_lines(records),
        *staleness_lines(records),
        *(["## Seconds per phase", "", seconds_table(records, wall_s), ""]
          if any(k.startswith("time/") and k != "time/sample_s" for r in records for k in r)
          else []),
        *(["## Money per phase", "",
           money_table([("whole run", total), ("GRPO only", grpo_usage)], *pricing), ""]
          if pricing is not None else []),
        "## Tokens per phase, whole run",
        "",
        phase_table(total),
        "",
        "## Tokens per phase, GRPO only (warm start and evaluations excluded)",
        "",
        phase_table(grpo_usage),
        "",
        "Train tokens are counted at every computed position, not only the positions in the "
        "loss: the forward and backward passes pay for all of them. A token prefix shared by "
        "datums of one forward_backward is computed, and counted, once; so when episodes "
        "of a group sample the same tokens, the loss can hold more positions than were "
        "computed.",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(parts))
    return path
