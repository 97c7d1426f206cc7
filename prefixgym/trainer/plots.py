"""The run's figures, drawn from metrics.jsonl: training.png, tokens.png, time.png and
mismatch.png.

- training.png: the warm-start loss against the warm-start step (its own axis: a
  warm start of 400 steps would otherwise squeeze 60 GRPO steps into a sliver; a
  dashed line where each stage of a staged warm start begins); below,
  against the GRPO step, the GRPO train reward (raw and smoothed); the invalid replies
  per episode and the update's gradient norm (a collapse of the reply format shows
  there first); eval success and eval mean reward with their standard errors. The
  evaluation after the warm start is at GRPO step 0; one of the starting weights
  ("before training") is a dashed line.
- tokens.png: one panel per phase -- prefill computed, prefill cached, sampled, train
  computed, train positions a shared prefix saved, train in the loss -- and the cache
  hit rate, per GRPO step, each on its own scale, so no series hides another (the
  warm start's totals are in report.md).
- time.png: each GRPO step's seconds, stacked by phase (prefill, decode,
  forward_backward, optim_step, publish, env steps) and the rest of its wall time.
- mismatch.png: per GRPO step, how far the sampler's logprobs are from the trainer's
  on the trained tokens (mean and max |difference|, log scale), the k3 estimate of
  KL(sampler || trainer), and the share of trained tokens whose importance weight an
  off-policy correction capped or masked (`versions.logprob_mismatch`), and how many
  versions behind the trainer's the step's samples were (--max-staleness).
Knows metric names; not how they were produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixgym.trainer.report import TIME_PHASES, eval_kind
from prefixgym.types import JSONObject

if TYPE_CHECKING:
    from matplotlib.axes import Axes

TOKEN_PANELS = (  # the grid's first row, then its second
    ("tokens/prefill_computed", "prefill, computed"),
    ("tokens/prefill_cached", "prefill, from the cache"),
    ("tokens/sampled", "sampled (decoded)"),
    ("tokens/train_computed", "train, computed"),
    ("tokens/train_shared", "train, shared prefix (not computed)"),
    ("tokens/train_loss", "train, in the loss"),
)


class _Timeline:
    """x positions: warm-start step i -> i + 1; GRPO step k -> k + 1, so that the
    evaluation after step k (logged as step k + 1) sits on it and the one after the warm
    start on 0."""

    def __init__(self, records: Sequence[JSONObject]) -> None:
        self.sft = [r for r in records if r.get("phase") == "sft"]
        self.grpo = [r for r in records if r.get("phase") == "grpo"]
        evals = [r for r in records if r.get("phase") == "eval"]
        self.start = [r for r in evals if r["when"] == "before training"]
        self.evals = [r for r in evals if r["when"] != "before training"]

    def sft_x(self) -> list[int]:
        return [int(r["sft_step"]) + 1 for r in self.sft]

    def stage_starts(self) -> list[tuple[int, int]]:
        """(x, stage) where a warm start in stages (`--sft-stages`) enters each one."""
        starts, last = [], None
        for x, r in zip(self.sft_x(), self.sft):
            stage = r.get("sft_stage")
            if stage is not None and stage != last:
                starts.append((x, int(stage)))
            last = stage
        return starts

    def grpo_x(self) -> list[int]:
        return [int(r["step"]) + 1 for r in self.grpo]

    def eval_x(self) -> list[int]:
        return [int(r["step"]) for r in self.evals]


def smoothed(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def write_plots(out: Path, records: Sequence[JSONObject]) -> list[Path]:
    """training.png, tokens.png, time.png and mismatch.png in `out`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = _Timeline(records)
    return [_training_plot(plt, out / "training.png", t), _tokens_plot(plt, out / "tokens.png", t),
            _time_plot(plt, out / "time.png", t), _mismatch_plot(plt, out / "mismatch.png", t)]


def _training_plot(plt: Any, path: Path, t: _Timeline) -> Path:
    """training.png: the warm-start loss, then per GRPO step the train reward, the
    replies' health and the evaluations (module docstring)."""
    fig, axes = plt.subplots(5, 1, figsize=(7.5, 11.5))
    loss_ax, reward_ax, health_ax, success_ax, eval_reward_ax = axes
    for ax in (health_ax, success_ax, eval_reward_ax):
        ax.sharex(reward_ax)
    if t.sft:
        loss_ax.plot(t.sft_x(), [r["sft/loss"] for r in t.sft], color="tab:purple")
        loss_ax.set_yscale("log")
        for x, stage in t.stage_starts()[1:]:  # where each stage after the first begins
            loss_ax.axvline(x - 0.5, color="gray", ls="--", lw=1)
            loss_ax.annotate(f" stage {stage}", (x - 0.5, 0.97), xycoords=("data", "axes fraction"),
                             va="top", fontsize=8, color="gray")
    _label(loss_ax, "warm-start loss\n(cross-entropy)", bool(t.sft), "no warm start")
    loss_ax.set_xlabel("warm-start step")
    if t.grpo:
        rewards = [float(r["reward/mean"]) for r in t.grpo]
        reward_ax.plot(t.grpo_x(), rewards, color="tab:blue", alpha=0.35, lw=1, label="per step")
        reward_ax.plot(t.grpo_x(), smoothed(rewards, max(2, len(rewards) // 10)),
                       color="tab:blue", lw=2, label="smoothed")
        reward_ax.legend(loc="lower right", fontsize=8)
    _label(reward_ax, "GRPO train reward\n(mean per episode)", bool(t.grpo), "no GRPO steps")
    _health(health_ax, t)
    _evaluations(success_ax, eval_reward_ax, t)
    eval_reward_ax.set_xlabel("GRPO step")
    for ax in axes:
        _integer_steps(ax)
    return _save(plt, fig, path, "Training run")


def _evaluations(success_ax: Axes, reward_ax: Axes, t: _Timeline) -> None:
    """Eval success and eval mean reward with their standard errors against the GRPO
    step; the starting weights' as a dashed line."""
    from matplotlib.ticker import PercentFormatter

    how = eval_kind([*t.start, *t.evals]).replace("sampled at ", "")
    # without a warm start the first evaluation is a GRPO one: no step-0 label then
    first = ("step 0: after the warm start"
             if t.evals and t.evals[0]["when"] == "after warm start" else None)
    for ax, key, err, colour, name, show in (
        (success_ax, "eval/success", "eval/success_stderr", "tab:green", "eval success",
         "{:.1%}"),
        (reward_ax, "eval/reward/mean", "eval/reward/stderr", "tab:orange",
         "eval mean reward", "{:.3f}"),
    ):
        if t.evals:
            ax.errorbar(t.eval_x(), [r[key] for r in t.evals],
                        yerr=[r.get(err, 0.0) for r in t.evals], fmt="o-", capsize=3,
                        color=colour, label=first)
        for r in t.start:
            ax.axhline(r[key], color="grey", ls="--", lw=1,
                       label=f"before training ({show.format(r[key])})")
        if first or t.start:
            ax.legend(loc="best", fontsize=8)
        _label(ax, f"{name}\n({how}, held-out)", bool(t.evals or t.start), "no evaluation")
    success_ax.yaxis.set_major_formatter(PercentFormatter(1.0))


def _tokens_plot(plt: Any, path: Path, t: _Timeline) -> Path:
    """tokens.png: one panel per phase's tokens and the cache hit rate, per GRPO step."""
    from matplotlib.ticker import PercentFormatter

    fig, grid = plt.subplots(2, 4, figsize=(13, 5.5), sharex=True)
    xs = t.grpo_x()
    panels = [*grid[0][:3], *grid[1][:3]]
    for ax, (key, name) in zip(panels, TOKEN_PANELS):
        points = [(x, r[key]) for x, r in zip(xs, t.grpo) if key in r]
        if points:
            ax.plot(*zip(*points), marker=".", ms=3, lw=1)
            ax.set_ylim(bottom=0)
        _label(ax, "tokens per step", bool(points), "no GRPO steps")
        ax.set_title(name, fontsize=10)
    grid[1][3].axis("off")
    hit_ax = grid[0][3]
    points = [(x, r["cache/hit_rate"]) for x, r in zip(xs, t.grpo)]
    if points:
        hit_ax.plot(*zip(*points), marker=".", ms=3, lw=1, color="tab:green")
        hit_ax.set_ylim(0, 1.02)
        hit_ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    _label(hit_ax, "of prompt tokens", bool(points), "no GRPO steps")
    hit_ax.set_title("prefix-cache hit rate", fontsize=10)
    for ax in (*panels, hit_ax):
        _integer_steps(ax)
    for ax in (*grid[1][:3], hit_ax):
        ax.set_xlabel("GRPO step")
    hit_ax.tick_params(labelbottom=True)
    return _save(plt, fig, path, "Tokens per phase, per GRPO step (the warm start's: report.md)")


MISMATCH_PANELS = (  # (panel, [(metric, label)], y label)
    ("gap", [("sampler/mean_logprob_gap", "mean"), ("sampler/max_logprob_gap", "max")],
     "|sampler - trainer|\nlogprob"),
    ("kl", [("sampler/kl_k3", "k3 estimate")], "KL(sampler || trainer)"),
    ("acted", [("off_policy/capped_fraction", "capped (tis)"),
               ("off_policy/masked_fraction", "masked (mis)")],
     "trained tokens\ncorrected"),
    ("lag", [("sampler/version_lag", "lag")], "versions behind\nthe trainer"),
)


def _mismatch_plot(plt: Any, path: Path, t: _Timeline) -> Path:
    """mismatch.png: the sampler/trainer mismatch of each GRPO step (module docstring)."""
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(len(MISMATCH_PANELS), 1, figsize=(7.5, 9), sharex=True)
    for ax, (panel, series, ylabel) in zip(axes, MISMATCH_PANELS):
        values: list[float] = []
        for key, name in series:
            points = [(x, float(r[key])) for x, r in zip(t.grpo_x(), t.grpo) if key in r]
            if points:
                ax.plot(*zip(*points), marker=".", ms=3, lw=1, label=name)
                values += [v for _, v in points]
        drawn = bool(values)
        if drawn:
            ax.legend(loc="upper left", fontsize=8)
            if panel == "gap" and min(values) > 0:  # float noise and real gaps, on one axis
                ax.set_yscale("log")
            if panel == "acted":
                ax.set_ylim(0, max(0.05, max(values) * 1.1))
            if panel == "lag":
                ax.set_ylim(-0.1, max(values) + 0.5)
                ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        empty = {"acted": "no off-policy correction", "lag": "weights versions not known"
                 }.get(panel, "no trained GRPO steps")
        _label(ax, ylabel, drawn, empty)
        _integer_steps(ax)
    axes[-1].set_xlabel("GRPO step")
    return _save(plt, fig, path, "Sampler / trainer mismatch on the trained tokens, per GRPO step")


def _time_plot(plt: Any, path: Path, t: _Timeline) -> Path:
    """time.png: each GRPO step's seconds, stacked by phase, and the rest of its wall."""
    fig, ax = plt.subplots(figsize=(9, 4.2))
    timed = [r for r in t.grpo if "time/prefill_s" in r]
    if timed:
        xs = [x for x, r in zip(t.grpo_x(), t.grpo) if "time/prefill_s" in r]
        bottom = [0.0] * len(timed)
        for key, name in TIME_PHASES:
            values = [float(r.get(f"time/{key}_s", 0.0)) for r in timed]
            ax.bar(xs, values, bottom=bottom, label=name, width=0.85)
            bottom = [b + v for b, v in zip(bottom, values)]
        rest = [max(float(r.get("time/step_s", 0.0)) - b, 0.0) for r, b in zip(timed, bottom)]
        ax.bar(xs, rest, bottom=bottom, label="the rest of the step", width=0.85,
               color="lightgrey")
        ax.legend(loc="upper right", fontsize=8, ncol=4)
        ax.set_ylim(top=max(b + r for b, r in zip(bottom, rest)) * 1.35)
    _label(ax, "seconds per step", bool(timed), "no timed GRPO steps")
    ax.set_xlabel("GRPO step")
    _integer_steps(ax)
    return _save(plt, fig, path, "Where each GRPO step's time went (the whole run's: report.md)")


def _health(ax: Axes, t: _Timeline) -> None:
    """Invalid replies per episode (left axis) and the gradient norm (right axis)."""
    invalid = [(x, r["invalid_actions/mean"]) for x, r in zip(t.grpo_x(), t.grpo)
               if "invalid_actions/mean" in r]
    norms = [(x, r["optim/grad_norm"]) for x, r in zip(t.grpo_x(), t.grpo)
             if "optim/grad_norm" in r]
    if invalid:
        ax.plot(*zip(*invalid), color="tab:red", lw=1.5, label="invalid replies per episode")
        ax.set_ylim(bottom=0)
    if norms:
        twin = ax.twinx()
        twin.plot(*zip(*norms), color="tab:grey", lw=1, alpha=0.7, label="gradient norm")
        twin.set_ylim(bottom=0)
        twin.set_ylabel("gradient norm", fontsize=9, color="tab:grey")
        ax.legend(handles=[*ax.get_lines(), *twin.get_lines()], loc="upper left", fontsize=8)
    _label(ax, "invalid replies\n(per episode)", bool(invalid or norms), "no GRPO steps")


def _label(ax: Axes, ylabel: str, has_data: bool, empty: str) -> None:
    ax.set_ylabel(ylabel, fontsize=9)
    ax.grid(alpha=0.3)
    if not has_data:
        ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center",
                color="grey")


def _integer_steps(ax: Axes) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _save(plt: Any, fig: Any, path: Path, title: str) -> Path:
    """Title `fig`, lay it out, write it to `path` and free it."""
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
