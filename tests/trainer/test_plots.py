"""training.png's evaluation panels say which point is which; its health panel shows
the invalid replies and gradient norms of the GRPO steps."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pytest
from matplotlib.figure import Figure

from prefixgym.trainer.plots import write_plots

matplotlib.use("Agg")


def _eval(when: str, step: int, success: float) -> dict:
    return {"phase": "eval", "when": when, "step": step, "eval/success": success,
            "eval/success_stderr": 0.01, "eval/reward/mean": success,
            "eval/reward/stderr": 0.01, "eval/temperature": 1.0}


def _grpo(step: int) -> dict:
    return {"phase": "grpo", "step": step, "reward/mean": 0.5, "cache/hit_rate": 0.9,
            "tokens/prefill_computed": 10, "tokens/prefill_cached": 90,
            "tokens/sampled": 20, "tokens/train_computed": 30,
            "tokens/train_shared": 40, "tokens/train_loss": 5}


def _legends(tmp_path: Path, records: list[dict], monkeypatch) -> list[list[str]]:
    """The legend labels of training.png's two evaluation panels."""
    seen: list[list[list[str]]] = []

    def save(fig: Figure, *args, **kwargs) -> None:
        seen.append([[t.get_text() for t in ax.get_legend().get_texts()]
                     if ax.get_legend() else [] for ax in fig.axes])

    monkeypatch.setattr(Figure, "savefig", save)
    write_plots(tmp_path, records)
    return seen[0][3:5]  # training.png: loss, reward, health, success, eval reward, twin


@pytest.mark.parametrize(("warm", "start", "want"), [
    (True, False, ["step 0: after the warm start"]),
    (True, True, ["step 0: after the warm start", "before training (2.0%)"]),
    (False, False, []),  # the first evaluation is a GRPO one: nothing is at step 0
    (False, True, ["before training (2.0%)"]),
])
def test_the_evaluation_legend_names_only_what_is_there(tmp_path, monkeypatch, warm, start,
                                                        want):
    records = [_eval("before training", 0, 0.02)] if start else []
    if warm:
        records += [{"phase": "sft", "step": 0, "sft_step": 0, "sft/loss": 1.0},
                    _eval("after warm start", 0, 0.5)]
    records += [_grpo(0), _grpo(1), _eval("GRPO", 2, 0.6)]
    success, reward = _legends(tmp_path, records, monkeypatch)
    assert sorted(success) == sorted(want)
    assert sorted(reward) == sorted(w.replace("2.0%", "0.020") for w in want)


def test_the_health_panel_plots_invalid_replies_and_gradient_norms(tmp_path, monkeypatch):
    records = [{**_grpo(k), "invalid_actions/mean": 0.1 * k, "optim/grad_norm": 2.0 + k}
               for k in range(3)]
    seen: list[dict[str, list]] = []

    def save(fig: Figure, *args, **kwargs) -> None:
        seen.append({line.get_label(): [list(line.get_xdata()), list(line.get_ydata())]
                     for ax in fig.axes for line in ax.get_lines()})

    monkeypatch.setattr(Figure, "savefig", save)
    write_plots(tmp_path, records)
    lines = seen[0]
    assert lines["invalid replies per episode"] == [[1, 2, 3], [0.0, 0.1, 0.2]]
    assert lines["gradient norm"] == [[1, 2, 3], [2.0, 3.0, 4.0]]


def test_the_warm_start_panel_marks_where_each_stage_begins(tmp_path, monkeypatch):
    stages = [1] * 3 + [2] * 2
    records = [{"phase": "sft", "step": 0, "sft_step": i, "sft_stage": stage, "sft/loss": 1.0}
               for i, stage in enumerate(stages)] + [_grpo(0)]
    seen: list[list[tuple[str, float]]] = []

    def save(fig: Figure, *args, **kwargs) -> None:
        loss_ax = fig.axes[0]
        seen.append([(t.get_text().strip(), t.xy[0]) for t in loss_ax.texts if hasattr(t, "xy")])

    monkeypatch.setattr(Figure, "savefig", save)
    write_plots(tmp_path, records)
    assert seen[0] == [("stage 2", 3.5)]  # x of step i is i + 1: between steps 2 and 3
    write_plots(tmp_path, [{k: v for k, v in r.items() if k != "sft_stage"} for r in records])
    assert seen[3] == []  # a warm start in one piece has no marks (1, 2: tokens, time.png)
