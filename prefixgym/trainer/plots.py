"""The run's two figures, drawn from metrics.jsonl: training.png and tokens.png.

Both share one time axis, the training step: warm-start steps 1..S first, then GRPO
step k at S + k + 1 (the shaded part is the warm start).
- training.png: the warm-start loss; the GRPO train reward, raw and smoothed; eval
  success and eval mean reward with their standard errors, at every evaluation
  (before training at 0, after the warm start at S).
- tokens.png: one panel per phase -- prefill computed, prefill cached, sampled, train
  computed, train positions a shared prefix saved, train in the loss -- and the cache
  hit rate, each on its own scale, so no series hides another.
Knows metric names; not how they were produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from prefixgym.trainer.report import eval_kind
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
    """x positions: warm-start step i -> i + 1, GRPO step k -> S + k + 1, eval at step k -> S + k."""

    def __init__(self, records: Sequence[JSONObject]) -> None:
        self.sft = [r for r in records if r.get("phase") == "sft"]
        self.grpo = [r for r in records if r.get("phase") == "grpo"]
        self.evals = [r for r in records if r.get("phase") == "eval"]
        self.warm_steps = len(self.sft)

    def sft_x(self) -> list[int]:
        return [int(r["sft_step"]) + 1 for r in self.sft]

    def grpo_x(self) -> list[int]:
        return [self.warm_steps + int(r["step"]) + 1 for r in self.grpo]

    def eval_x(self) -> list[int]:
        return [0 if r["when"] == "before training" else self.warm_steps + int(r["step"])
                for r in self.evals]


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
    """training.png and tokens.png in `out`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = _Timeline(records)
    paths = [out / "training.png", out / "tokens.png"]

    fig, axes = plt.subplots(4, 1, figsize=(7.5, 9.5), sharex=True)
    loss_ax, reward_ax, success_ax, eval_reward_ax = axes
    if t.sft:
        loss_ax.plot(t.sft_x(), [r["sft/loss"] for r in t.sft], color="tab:purple")
        loss_ax.set_yscale("log")
    _label(loss_ax, "warm-start loss\n(cross-entropy)", bool(t.sft), "no warm start")
    if t.grpo:
        rewards = [float(r["reward/mean"]) for r in t.grpo]
        reward_ax.plot(t.grpo_x(), rewards, color="tab:blue", alpha=0.35, lw=1, label="per step")
        reward_ax.plot(t.grpo_x(), smoothed(rewards, max(2, len(rewards) // 10)),
                       color="tab:blue", lw=2, label="smoothed")
        reward_ax.legend(loc="lower right", fontsize=8)
    _label(reward_ax, "GRPO train reward\n(mean per episode)", bool(t.grpo), "no GRPO steps")
    how = eval_kind(t.evals).replace("sampled at ", "")
    for ax, key, err, colour, name in (
        (success_ax, "eval/success", "eval/success_stderr", "tab:green", "eval success"),
        (eval_reward_ax, "eval/reward/mean", "eval/reward/stderr", "tab:orange",
         "eval mean reward"),
    ):
        if t.evals:
            ax.errorbar(t.eval_x(), [r[key] for r in t.evals],
                        yerr=[r.get(err, 0.0) for r in t.evals], fmt="o-", capsize=3,
                        color=colour)
        _label(ax, f"{name}\n({how}, held-out)", bool(t.evals), "no evaluation")
    success_ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    eval_reward_ax.set_xlabel("training step (shaded: warm start, then GRPO)")
    for ax in axes:
        _shade_warm_start(ax, t.warm_steps)
    fig.suptitle("Training run")
    fig.tight_layout()
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    fig, grid = plt.subplots(2, 4, figsize=(13, 5.5), sharex=True)
    steps = [*t.sft, *t.grpo]
    xs = [*t.sft_x(), *t.grpo_x()]
    panels = [*grid[0][:3], *grid[1][:3]]
    for ax, (key, name) in zip(panels, TOKEN_PANELS):
        points = [(x, r[key]) for x, r in zip(xs, steps) if key in r]
        if points:
            ax.plot(*zip(*points), marker=".", ms=3, lw=1)
            ax.set_ylim(bottom=0)
        _label(ax, "tokens per step", bool(points),
               "no GRPO steps" if key.startswith(("tokens/prefill", "tokens/sampled")) else "none")
        ax.set_title(name, fontsize=10)
    grid[1][3].axis("off")
    hit_ax = grid[0][3]
    points = [(x, r["cache/hit_rate"]) for x, r in zip(t.grpo_x(), t.grpo)]
    if points:
        hit_ax.plot(*zip(*points), marker=".", ms=3, lw=1, color="tab:green")
        hit_ax.set_ylim(0, 1.02)
        hit_ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    _label(hit_ax, "of prompt tokens", bool(points), "no GRPO steps")
    hit_ax.set_title("prefix-cache hit rate", fontsize=10)
    for ax in (*panels, hit_ax):
        _shade_warm_start(ax, t.warm_steps)
    for ax in (*grid[1][:3], hit_ax):
        ax.set_xlabel("training step")
    hit_ax.tick_params(labelbottom=True)
    fig.suptitle("Tokens per phase, per training step")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    return paths


def _label(ax: Axes, ylabel: str, has_data: bool, empty: str) -> None:
    ax.set_ylabel(ylabel, fontsize=9)
    ax.grid(alpha=0.3)
    if not has_data:
        ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center",
                color="grey")


def _shade_warm_start(ax: Axes, warm_steps: int) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if warm_steps:
        ax.axvspan(0, warm_steps, color="grey", alpha=0.08, lw=0)
