"""Evaluation: greedy by default, or sampled at a temperature, reproducibly."""

import json

import pytest

from prefixgym.cli.train import train
from prefixgym.envs.registration import make_env
from prefixgym.local_service import LocalService
from prefixgym.rollouts.rollout import RolloutConfig
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.evaluate import evaluate


def test_sampled_evaluation_is_reproducible_and_differs_from_greedy():
    envs = [make_env("tests/Lengthy-v0") for _ in range(4)]
    config = RolloutConfig(max_tokens=6, temperature=1.0)
    with LocalService(model="tiny", seed=0) as service:
        sampler = service.create_sampling_client()

        def run(temperature: float) -> tuple[float, int]:
            result = evaluate(sampler, service.tokenizer, envs, 12, config,
                              temperature=temperature)
            return result.reward, result.usage.sampled_tokens

        greedy, sampled = run(0.0), run(1.0)
        assert run(0.0) == greedy  # RolloutConfig's temperature is not what greedy uses
        assert run(1.0) == sampled
        assert sampled != greedy


def test_a_deterministic_evaluation_does_not_depend_on_how_many_episodes_play_at_once():
    """`prefixgym train` plays `EVAL_WIDTH` evaluation episodes at once: only the time
    may depend on that number."""
    config = RolloutConfig(max_tokens=6, temperature=1.0, lockstep=True)
    with LocalService(model="tiny", seed=0, deterministic=True) as service:
        sampler = service.create_sampling_client()

        def run(width: int) -> tuple[float, float, int, int]:
            envs = [make_env("tests/Lengthy-v0") for _ in range(width)]
            result = evaluate(sampler, service.tokenizer, envs, 12, config, temperature=1.0)
            return (result.reward, result.success, result.usage.sampled_tokens,
                    result.usage.prefill_computed_tokens + result.usage.prefill_cached_tokens)

        assert run(12) == run(5) == run(1)


def test_report_and_metrics_name_the_evaluation_temperature(tmp_path):
    config = TrainConfig(env="tests/Lengthy-v0", sft_steps=1, sft_episodes_per_step=2,
                         groups_per_step=1, group_size=2, steps=1, eval_episodes=4,
                         eval_every=1, max_tokens=4, progress=False, out=str(tmp_path),
                         eval_temperature=0.7)
    train(config)
    records = list(map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()))
    evals = [r for r in records if r["phase"] == "eval"]
    assert evals and all(r["eval/temperature"] == 0.7 for r in evals)
    report = (tmp_path / "report.md").read_text()
    assert "## Evaluation (sampled at temperature 0.7, held-out seeds)" in report
    # the GRPO-only token table counts the GRPO steps' tokens, not the evaluations'
    grpo_only = report.split("## Tokens per phase, GRPO only (warm start and evaluations "
                             "excluded)")[1]
    sampled = sum(int(r["tokens/sampled"]) for r in records if r["phase"] == "grpo")
    assert f"| sample (decoded tokens) | {sampled:,} |" in grpo_only
    assert sampled < sum(int(r["tokens/sampled"]) for r in records if r["phase"] != "sft")


def test_negative_evaluation_temperature_is_refused():
    with pytest.raises(ValueError, match="--eval-temperature must be >= 0"):
        TrainConfig(eval_temperature=-0.5)


def test_evaluation_samples_as_grpo_does_unless_told_otherwise():
    assert TrainConfig().eval_temperature == TrainConfig().temperature == 1.0
    assert TrainConfig(temperature=0.7).eval_temperature == 0.7
    assert TrainConfig(temperature=0.7, eval_temperature=0.0).eval_temperature == 0.0


def test_a_resumed_run_saved_without_eval_temperature_keeps_evaluating_greedily(tmp_path):
    from dataclasses import asdict

    from prefixgym.cli.train_args import saved_run_config

    saved = {k: v for k, v in asdict(TrainConfig()).items() if k != "eval_temperature"}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    resumed = saved_run_config({"resume": True, "out": str(tmp_path)})
    assert TrainConfig(**resumed).eval_temperature == 0.0
