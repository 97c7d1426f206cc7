"""`prefixgym estimate`: the pilot's config, the extrapolation's arithmetic, and a pilot
that covers the whole run predicting that run's tokens exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixgym.cli import main as cli_main
from prefixgym.cli.train import train
from prefixgym.pricing import run_prices
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.estimate import (
    eval_batches,
    evaluations_in,
    extrapolate,
    pilot_config,
)
from prefixgym.trainer.report import MetricsLog, usage_of
from prefixgym.types import Usage

SMALL = dict(env="tests/Lengthy-v0", sft_steps=2, sft_episodes_per_step=2, groups_per_step=2,
             group_size=3, eval_episodes=4, eval_every=2, max_tokens=6, progress=False)


def test_the_pilot_is_the_run_cut_short() -> None:
    config = TrainConfig(sft_steps=400, steps=60, eval_episodes=1500, eval_every=30,
                         sft_stages=[{"steps": 300}, {"steps": 100, "env_kwargs": {"high": 8}}],
                         resume=True, trace="t.jsonl")
    pilot = pilot_config(config, "p", sft_steps=20, steps=4)
    assert (pilot.sft_steps, pilot.steps, pilot.eval_episodes) == (20, 4, 512)
    assert [s["steps"] for s in pilot.sft_stages] == [15, 5]  # scaled alike
    assert pilot.sft_stages[1]["env_kwargs"] == {"high": 8}
    assert (pilot.eval_every, pilot.checkpoint_every) == (4, 4)  # one evaluation at the end
    assert (pilot.out, pilot.resume, pilot.trace) == ("p", False, "p/trace.jsonl")
    assert (pilot.lr, pilot.group_size, pilot.env) == (config.lr, config.group_size, config.env)
    full = pilot_config(TrainConfig(sft_steps=10, steps=3), "p", sft_steps=None, steps=8)
    assert (full.sft_steps, full.steps) == (10, 3)


def test_evaluations_are_counted_as_a_run_makes_them() -> None:
    assert evaluations_in(TrainConfig(sft_steps=400, steps=60, eval_every=30)) == 3
    assert evaluations_in(TrainConfig(sft_steps=0, steps=61, eval_every=30,
                                      eval_on_start=True)) == 4  # start, 30, 60, 61
    assert evaluations_in(TrainConfig(sft_steps=5, steps=0)) == 1


def test_each_part_is_the_pilots_mean_per_unit_times_the_runs_units() -> None:
    def step(phase: str, computed: int, seconds: float, **more: float) -> dict:
        return {"phase": phase, "tokens/prefill_computed": computed, "tokens/sampled": 10,
                "tokens/train_computed": 5, "time/step_s": seconds, **more}

    records = [step("sft", 0, 1.0), step("sft", 20, 3.0),
               step("grpo", 100, 2.0), step("grpo", 300, 4.0),
               {**step("eval", 400, 0.0), "eval/episodes": 4, "time/eval_s": 8.0}]
    config = TrainConfig(sft_steps=10, steps=6, eval_every=3, eval_episodes=100)
    parts = {p.name: p for p in extrapolate(config, records)}
    sft, grpo, ev = parts["warm_start"], parts["grpo"], parts["eval"]
    assert sft.usage.prefill_computed_tokens == 100 and sft.usage.sampled_tokens == 100
    assert sft.seconds == (20.0, 10.0, 30.0)  # mean 2 s, cheapest and dearest step alike
    assert grpo.usage.computed_tokens == 6 * (200 + 15)
    assert (grpo.low.computed_tokens, grpo.high.computed_tokens) == (6 * 115, 6 * 315)
    # evaluations: after the warm start, at steps 3 and 6, of 100 episodes at the
    # pilot's rate per episode (no trace to tell its batches apart)
    assert ev.units == 3 and ev.usage.prefill_computed_tokens == 300 * 100
    assert ev.seconds[0] == pytest.approx(300 * 2.0)


def test_an_evaluation_is_its_first_batch_and_later_episodes_at_the_second_batchs_rate(
        ) -> None:
    def line(group: str, computed: int) -> dict:
        return {"group_id": group, "usage": {"prefill_computed_tokens": computed,
                                             "sampled_tokens": 1}}

    # the pilot's one evaluation: 512 episodes; the first batch paid 30 tokens each
    trace = ([line(f"eval0/{s}", 30) for s in range(256)]
             + [line(f"eval0/{s}", 5) for s in range(256, 512)]
             + [line("step0/g0", 999), {"prompt_tokens": [1], "usage": {}}])
    assert [[u.prefill_computed_tokens for u in b] for b in eval_batches(trace).values()] == [
        [256 * 30, 256 * 5]]
    record = {"phase": "eval", "eval/episodes": 512, "time/eval_s": 5.12,
              "tokens/prefill_computed": 256 * 35, "tokens/sampled": 512}
    config = TrainConfig(sft_steps=0, steps=0, eval_on_start=True, eval_episodes=1500)
    [ev] = extrapolate(config, [record], trace)
    assert ev.usage.prefill_computed_tokens == 256 * 30 + (1500 - 256) * 5
    assert ev.usage.sampled_tokens == 1500 and ev.seconds[0] == pytest.approx(15.0)
    small = TrainConfig(sft_steps=0, steps=0, eval_on_start=True, eval_episodes=100)
    [ev] = extrapolate(small, [record], trace)  # one batch: the first's rate
    assert ev.usage.prefill_computed_tokens == 100 * 30


def test_a_pilot_that_covers_the_run_predicts_its_tokens_exactly(tmp_path: Path,
                                                               capsys) -> None:
    flags = ["--out", str(tmp_path / "est"), "--pilot-sft-steps", "all", "--pilot-steps", "2"]
    for k, v in SMALL.items():
        flags += ["--no-progress"] if k == "progress" else [f"--{k.replace('_', '-')}", str(v)]
    assert cli_main(["estimate", *flags, "--steps", "2"]) == 0
    printed = capsys.readouterr().out
    assert "warm start (2 steps)" in printed and "assumptions:" in printed
    estimate = json.loads((tmp_path / "est" / "estimate.json").read_text())
    assert set(estimate["parts"]) == {"warm_start", "grpo", "eval"}
    # the same run, for real
    result = train(TrainConfig(**SMALL, steps=2, out=str(tmp_path / "run")))
    records = MetricsLog(tmp_path / "run" / "metrics.jsonl").read()
    for name, phase in (("warm_start", "sft"), ("grpo", "grpo"), ("eval", "eval")):
        actual = Usage.total(usage_of(r) for r in records if r["phase"] == phase)
        part = estimate["parts"][name]
        assert part["tokens_computed"] == actual.computed_tokens, name
        assert part["tokens_without_sharing"] == (actual.prefill_tokens + actual.sampled_tokens
                                                  + actual.train_tokens)
        assert part["prefill_cached"] == actual.prefill_cached_tokens
        assert part["train_shared"] == actual.train_shared_tokens
        low, high = part["tokens_computed_interval"]
        assert low <= part["tokens_computed"] <= high
    total = estimate["total"]
    assert total["tokens_computed"] == result.usage.computed_tokens
    prices, _ = run_prices("tiny")
    assert total["cost"] == pytest.approx(result.usage.cost(prices).total, abs=1e-6)
    assert estimate["prices"]["model"] == prices.model and estimate["assumptions"]


def test_estimate_refuses_resume_and_bad_pilot_sizes(capsys) -> None:
    assert cli_main(["estimate", "--resume"]) == 2
    assert capsys.readouterr().err.strip() == (
        "prefixgym estimate: --resume: estimate prices a run from its start; run it without")
    with pytest.raises(SystemExit) as e:
        cli_main(["estimate", "--pilot-sft-steps", "some"])
    assert e.value.code == 2
