"""Off-policy corrections and the mismatch metrics in a GRPO step and a run: samples
whose sampler logprobs are forced off the trainer's, an --async run, the config's
flags, report.md's table and mismatch.png."""

from __future__ import annotations

import json
import math

import pytest
from matplotlib.figure import Figure

from prefixgym.cli.train import train
from prefixgym.cli.train_args import parse_train_config
from prefixgym.engine.trainer import losses
from prefixgym.envs.registration import make_env
from prefixgym.local_service import LocalService
from prefixgym.rollouts.rollout import RolloutConfig
from prefixgym.trainer.config import GRPO_LOSSES, TrainConfig, loss_fn_config
from prefixgym.trainer.grpo import collect, grpo_step
from prefixgym.trainer.off_policy_report import mismatch_lines
from prefixgym.trainer.plots import write_plots
from prefixgym.types import DECOUPLED_LOSS_FN_NAMES

SMALL = dict(env="tests/Lengthy-v0", sft_steps=1, sft_episodes_per_step=2, groups_per_step=2,
             group_size=3, eval_episodes=1, eval_every=10, max_tokens=6, progress=False)


def _step_with_sampler_off_by(shift: float, **settings: object) -> dict[str, float]:
    """One GRPO step whose sampled tokens' sampler logprobs are moved by `shift`."""
    config = TrainConfig(**SMALL, steps=1, **settings)  # type: ignore[arg-type]
    with LocalService(model="tiny", seed=0) as service:
        training = service.create_training_client()
        envs = [make_env(config.env, config.env_kwargs) for _ in range(6)]
        groups, _ = collect(service.create_sampling_client(), service.tokenizer, envs, config,
                            0, RolloutConfig(max_tokens=6))
        for group in groups:
            for traj in group.trajectories:
                traj.logprobs = [lp + shift if sampled else lp
                                 for lp, sampled in zip(traj.logprobs, traj.sampled_mask)]
        metrics, _ = grpo_step(training, groups, config, None)
    assert metrics["datums/count"] > 0, "the test env gives varied rewards, so a group trains"
    return metrics


def test_a_sampler_that_overrates_every_token_is_measured_and_masked() -> None:
    # the trainer's logprob is the sampler's - 1: rho = e^-1 = 0.37, below the mask's 0.5
    metrics = _step_with_sampler_off_by(1.0, off_policy_correction="mis",
                                        off_policy_mask_low=0.5)
    assert metrics["sampler/mean_logprob_gap"] == pytest.approx(1.0, abs=0.02)
    assert metrics["sampler/max_logprob_gap"] == pytest.approx(1.0, abs=0.02)
    assert metrics["sampler/kl_k3"] == pytest.approx(math.exp(-1.0), abs=0.02)  # e^-1 - 1 + 1
    assert metrics["off_policy/masked_fraction"] == 1.0
    assert metrics["off_policy/weight_mean"] == 0.0
    assert metrics["optim/grad_norm"] == 0.0  # every token left the loss


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_sampler_that_underrates_every_token_is_capped(level: str) -> None:
    # rho = e^1 = 2.7 > the cap 2: every weight is 2
    metrics = _step_with_sampler_off_by(-1.0, off_policy_correction="tis", off_policy_level=level)
    assert metrics["off_policy/capped_fraction"] == 1.0
    assert metrics["off_policy/weight_mean"] == pytest.approx(2.0)
    # ppo's ratio to the sampler is e^1 on every token: the clip holds those with A > 0
    assert 0.0 < metrics["loss/clip_fraction"] < 1.0
    assert metrics["sampler/kl_k3"] == pytest.approx(math.exp(1.0) - 2.0, abs=0.05)


def test_an_async_run_logs_the_mismatch_every_step_and_reports_it(tmp_path, monkeypatch) -> None:
    drawn: list[str] = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: drawn.append(str(path)))
    train(TrainConfig(**SMALL, steps=3, out=str(tmp_path), async_mode=True,
                      off_policy_correction="tis", off_policy_cap=1.0))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in lines if r["phase"] == "grpo" and r["datums/count"]]
    assert trained
    for r in trained:
        assert 0 <= r["sampler/mean_logprob_gap"] <= r["sampler/max_logprob_gap"]
        assert r["sampler/kl_k3"] >= 0 and 0 <= r["off_policy/capped_fraction"] <= 1
        assert r["off_policy/weight_mean"] <= 1.0  # the cap is 1
    lagged = [r for r in trained if r["sampler/version_lag"] == 1]
    assert all(r["sampler/max_logprob_gap"] > 1e-4 for r in lagged)  # one update apart
    report = (tmp_path / "report.md").read_text()
    assert "## Sampler / trainer mismatch" in report and "tokens capped (tis)" in report
    assert any(p.endswith("mismatch.png") for p in drawn)


def test_mismatch_lines_average_the_steps_that_trained() -> None:
    records = [{"phase": "grpo", "sampler/kl_k3": 0.1, "sampler/mean_logprob_gap": 0.2,
                "sampler/max_logprob_gap": 1.0},
               {"phase": "grpo"},  # a step that trained nothing
               {"phase": "grpo", "sampler/kl_k3": 0.3, "sampler/mean_logprob_gap": 0.4,
                "sampler/max_logprob_gap": 2.0}]
    lines = mismatch_lines(records)
    assert "Over the trained tokens of 2 GRPO steps" in lines[2]
    assert "| max abs logprob gap | 1.5 | 2 | 2 |" in lines
    assert "| KL(sampler \\|\\| trainer), k3 | 0.2 | 0.3 | 0.3 |" in lines
    assert not any("capped" in line for line in lines)
    assert mismatch_lines([{"phase": "grpo"}]) == []


def test_mismatch_png_is_drawn_with_or_without_a_correction(tmp_path) -> None:
    records = [{"phase": "grpo", "step": 0, "reward/mean": 0.5, "cache/hit_rate": 0.5,
                "sampler/mean_logprob_gap": 1e-6, "sampler/max_logprob_gap": 1e-5,
                "sampler/kl_k3": 1e-9}]
    paths = write_plots(tmp_path, records)
    assert (tmp_path / "mismatch.png") in paths and (tmp_path / "mismatch.png").stat().st_size


@pytest.mark.parametrize(("level", "want"), [
    ("token", {"off_policy_tis_cap": 3.0, "off_policy_sequence": 0.0,
               "off_policy_decoupled": 0.0}),
    ("sequence", {"off_policy_tis_cap": 3.0, "off_policy_sequence": 1.0,
                  "off_policy_decoupled": 0.0}),
])
def test_the_flags_make_a_loss_config_the_engine_takes(level: str, want: dict) -> None:
    config = parse_train_config(["--off-policy-correction", "tis", "--off-policy-cap", "3",
                                 "--off-policy-level", level])
    assert loss_fn_config(config) == want
    assert losses.validate_config(config.loss, want)["off_policy_tis_cap"] == 3.0
    mis = TrainConfig(off_policy_correction="mis")
    assert loss_fn_config(mis) == {"off_policy_mis_low": 0.125, "off_policy_mis_high": 8.0,
                                   "off_policy_sequence": 0.0, "off_policy_decoupled": 0.0}
    assert loss_fn_config(TrainConfig()) is None
    decoupled = {**want, "off_policy_decoupled": 1.0}
    for loss in GRPO_LOSSES:  # the losses the flags take are those the engine corrects
        assert losses.validate_config(loss, want)["off_policy_tis_cap"] == 3.0
        if loss in DECOUPLED_LOSS_FN_NAMES:
            TrainConfig(loss=loss, off_policy_correction="tis", off_policy_ratio="trainer")
            assert losses.validate_config(loss, decoupled)["off_policy_decoupled"] == 1.0
        else:
            with pytest.raises(ValueError, match="takes no decoupled correction"):
                losses.validate_config(loss, decoupled)


@pytest.mark.parametrize(("settings", "match"), [
    ({"off_policy_correction": "is"}, "--off-policy-correction must be one of none, tis, mis"),
    ({"off_policy_correction": "tis", "loss": "dro", "off_policy_ratio": "trainer"},
     "--off-policy-ratio trainer needs --loss importance_sampling"),
    ({"off_policy_ratio": "old"}, "--off-policy-ratio must be one of sampler, trainer"),
    ({"off_policy_correction": "tis", "backend": "tinker"}, "local backend only"),
    ({"off_policy_cap": 0.5}, "--off-policy-cap must be >= 1"),
    ({"off_policy_mask_low": 2.0}, "0 <= low <= 1 <= high"),
    ({"off_policy_level": "batch"}, "--off-policy-level must be one of token, sequence"),
])
def test_bad_correction_settings_are_refused(settings: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TrainConfig(**settings)
