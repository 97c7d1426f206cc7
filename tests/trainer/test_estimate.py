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
from prefixgym.trainer.estimate_bounds import (
    all_groups_trained,
    collapsed,
    converged,
    expert_length,
    grpo_length,
    lengthened,
    load_factors,
    midpoint,
    sampled_total,
    scaled,
    shape_of,
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
    """Without a trace or an expert's lengths: the warm start a sampled total, GRPO and
    the evaluations between a converged policy and the pilot's, the estimate halfway."""
    def step(phase: str, computed: int, seconds: float, **more: float) -> dict:
        return {"phase": phase, "tokens/prefill_computed": computed, "tokens/sampled": 10,
                "tokens/train_computed": 4, "time/step_s": seconds, **more}

    records = [step("sft", 0, 1.0, **{"tokens/train_computed": 0}),
               step("sft", 20, 3.0, **{"tokens/train_computed": 0}),
               step("grpo", 100, 2.0), step("grpo", 300, 4.0),
               {**step("eval", 400, 0.0), "eval/episodes": 4, "time/eval_s": 8.0}]
    config = TrainConfig(sft_steps=10, steps=6, eval_every=3, eval_episodes=100,
                         group_size=2)
    parts = {p.name: p for p in extrapolate(config, records)}
    sft, grpo, ev = parts["warm_start"], parts["grpo"], parts["eval"]
    assert sft.usage.prefill_computed_tokens == 100 and sft.usage.sampled_tokens == 100
    # seconds: mean 2 s a step, sd sqrt(2): 3 * sqrt(2) * sqrt(10 + 100 / 2) either side,
    # none below 0
    half = 3 * 2 ** 0.5 * 60 ** 0.5
    assert sft.seconds == pytest.approx((20.0, 0.0, 20.0 + half))
    # GRPO's mean step: 200 prefill computed, 10 sampled, 4 train computed. No expert
    # measured, so episodes 0.9x to 1.1x the pilot's (LENGTH_SLACK). Low: the prefill
    # computed once for the group of 2 (no first turn in the trace) and by 0.81, the
    # samples by 0.9, nothing trained: 81 + 9. High: 242 + 11 + 4.
    assert (grpo.low.computed_tokens, grpo.high.computed_tokens) == (6 * 90, 6 * 257)
    assert grpo.usage == midpoint(grpo.low, grpo.high)
    # seconds: no pass timed, so the mean step's 3 s whatever the tokens
    assert grpo.seconds == pytest.approx((18.0, 18.0, 18.0))
    # evaluations: after the warm start, at steps 3 and 6, of 100 episodes at the
    # pilot's rate per episode (no trace to tell its batches apart): 10,000 prefill
    # computed, halved and by 0.81 (low), by 1.21 (high)
    assert ev.units == 3 and ev.high.prefill_computed_tokens == 3 * 12100
    assert ev.low.prefill_computed_tokens == 3 * 4050
    assert ev.seconds[0] == pytest.approx(300 * 2.0)
    for part in parts.values():
        assert part.low.computed_tokens <= part.usage.computed_tokens <= part.high.computed_tokens
        assert (part.low.tokens_without_sharing <= part.usage.tokens_without_sharing
                <= part.high.tokens_without_sharing)
        assert part.seconds[1] <= part.seconds[0] <= part.seconds[2]
        assert part.why[0] and part.why[1] and not part.exact


def test_bounds_by_hand() -> None:
    # a sampled total: 4 units like [9, 11]: 40 +- 3 * sqrt(2) * sqrt(4 + 16 / 2)
    mid, low, high = sampled_total([9.0, 11.0], 4)
    assert (mid, low, high) == pytest.approx((40.0, 40 - 14.6969, 40 + 14.6969), abs=1e-3)
    assert sampled_total([0.0, 10.0], 1)[1] == 0.0  # never below zero
    # entropy zero: a group of 4 computes its later prompts and training once
    usage = Usage(prefill_computed_tokens=100, prefill_cached_tokens=50, sampled_tokens=40,
                  train_computed_tokens=80, train_shared_tokens=20)
    low = collapsed(usage, first_turn_prefill=20, group_size=4)
    assert (low.prefill_computed_tokens, low.prefill_cached_tokens) == (20 + 20, 110)
    assert (low.sampled_tokens, low.train_computed_tokens, low.train_shared_tokens) == (
        40, 20, 80)
    assert low.tokens_without_sharing == usage.tokens_without_sharing == 290
    # converged: that, and nothing trained; episodes twice as long: prompts 4x
    done = converged(usage, first_turn_prefill=20, group_size=4, ratio=2.0)
    assert (done.prefill_computed_tokens, done.prefill_cached_tokens) == (160, 440)
    assert (done.sampled_tokens, done.train_computed_tokens, done.train_tokens) == (80, 0, 0)
    longer = lengthened(usage, 2.0)
    assert (longer.prefill_tokens, longer.sampled_tokens, longer.train_tokens) == (
        600, 80, 200)
    # every group trained: 4 of 16 skipped in the pilot, so 16/12 of its training
    high = all_groups_trained(usage, skipped=4, groups=16)
    assert (high.train_computed_tokens, high.train_shared_tokens) == (107, 27)
    assert high.prefill_computed_tokens == 100
    # seconds: load 6 on 2 cores had a third of the processor; up to 8
    assert load_factors(6.0, 2) == pytest.approx((1 / 3, 4 / 3))
    assert load_factors(1.0, 2, max_load=3.0) == pytest.approx((1.0, 1.5))
    assert load_factors(20.0, 2) == pytest.approx((0.1, 1.0))  # above it: the pilot is high


def test_episode_lengths_bound_the_volume_and_first_turns_stay_computed() -> None:
    # the experts' episodes: 100 and 150 positions; the pilot's GRPO: 250 positions
    # over its one trained group of 2 episodes = 125
    assert expert_length([{"tokens/train_computed": 300, "tokens/train_shared": 100}],
                         4) == 100
    grpo = [{"phase": "grpo", "tokens/prefill_computed": 26, "tokens/prefill_cached": 10,
             "tokens/sampled": 10, "tokens/train_computed": 200, "tokens/train_shared": 50,
             "groups/skipped": 1.0, "time/step_s": 10.0, "time/prefill_s": 2.0,
             "time/decode_s": 3.0, "time/forward_backward_s": 4.0}]
    assert grpo_length(grpo, groups=2, group_size=2) == 125

    def line(group: str, turn: int, computed: int) -> dict:
        return {"group_id": group, "turn": turn, "usage": {"prefill_computed_tokens": computed}}

    trace = [line("step0/g0", 0, 10), line("step0/g0", 1, 6), line("step0/g1", 0, 10),
             line("eval0/0", 0, 8), line("eval0/0", 1, 24)]
    shape = shape_of(trace, 125, [100, 150])
    assert (shape.length_low, shape.length_high) == pytest.approx((0.8 * 0.9, 1.2 * 1.1))
    assert shape.first_turn_prefill == 20 and shape.eval_first_turn_share == 0.25
    config = TrainConfig(sft_steps=0, steps=10, groups_per_step=2, group_size=2,
                         eval_every=100)
    [part] = [p for p in extrapolate(config, grpo, trace, load=(0.5, 2.0))
              if p.name == "grpo"]
    mean = usage_of(grpo[0])
    # no warm start measured here, so 0.9x to 1.1x the pilot's length
    assert part.low == scaled(converged(mean, 20, 2, 0.9), 10)
    assert part.high == scaled(lengthened(all_groups_trained(mean, 1.0, 2), 1.1), 10)
    assert part.usage == midpoint(part.low, part.high)
    # seconds: the rest (1 s) fixed, prefill, decode and training in proportion to
    # their tokens; low alone (0.5x), high at the highest load (2x)
    def seconds(u: Usage) -> float:
        return 10 * (1 + 2 * u.prefill_computed_tokens / 260 + 3 * u.sampled_tokens / 100
                     + 4 * u.train_computed_tokens / 2000)

    assert part.seconds[1] == pytest.approx(seconds(part.low) * 0.5, rel=0.02)
    assert part.seconds[2] == pytest.approx(seconds(part.high) * 2.0, rel=0.02)


def test_warm_start_stages_are_extrapolated_each_from_its_own_pilot_steps() -> None:
    config = TrainConfig(sft_steps=300, steps=0, sft_stages=[{"steps": 250}, {"steps": 50}])
    pilot = pilot_config(config, "p")
    assert [s["steps"] for s in pilot.sft_stages] == [17, 3]
    records = [{"phase": "sft", "tokens/train_computed": 10 if i < 17 else 40,
                "tokens/train_shared": 5, "time/step_s": 1.0} for i in range(20)]
    [sft] = extrapolate(config, records)
    assert sft.usage.train_computed_tokens == 250 * 10 + 50 * 40
    assert sft.low.computed_tokens == sft.high.computed_tokens == 4500  # no spread
    assert sft.low.tokens_without_sharing == 300 * 5 + 4500


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
        # the pilot ran every part in full: exact, the intervals one point
        assert part["exact"] and part["tokens_computed_interval"] == [
            actual.computed_tokens] * 2
        assert part["tokens_without_sharing_interval"] == [part["tokens_without_sharing"]] * 2
        low, high = part["seconds_interval"]
        assert low <= part["seconds"] <= high
    total = estimate["total"]
    assert total["tokens_computed"] == result.usage.computed_tokens
    prices, _ = run_prices("tiny")
    assert total["cost"] == pytest.approx(result.usage.cost(prices).total, abs=1e-6)
    assert estimate["prices"]["model"] == prices.model and estimate["assumptions"]
    assert estimate["pilot"]["cores"] >= 1 and estimate["pilot"]["load"] >= 0


def test_estimate_refuses_resume_and_bad_pilot_sizes(capsys) -> None:
    assert cli_main(["estimate", "--resume"]) == 2
    assert capsys.readouterr().err.strip() == (
        "prefixgym estimate: --resume: estimate prices a run from its start; run it without")
    for bad in (["--pilot-sft-steps", "some"], ["--max-load", "0"], ["--max-load", "x"]):
        with pytest.raises(SystemExit) as e:
            cli_main(["estimate", *bad])
        assert e.value.code == 2
        assert len(capsys.readouterr().err.strip().splitlines()[-1]) < 200
