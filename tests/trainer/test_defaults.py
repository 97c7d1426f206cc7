"""The warm-start learning-rate schedule and the compute dtype option."""

import itertools
import math

import pytest
import torch

from prefixgym.cli import train as train_command
from prefixgym.cli.train import compute_dtype
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.schedule import warmup_cosine_lr


def test_sft_schedule_warms_up_then_decays_to_a_tenth():
    lrs = [warmup_cosine_lr(i, 100, 1e-3) for i in range(100)]
    assert lrs[0] == pytest.approx(1e-4)  # warm-up: 1/10 of the way after step 0
    assert lrs[9] == pytest.approx(1e-3)  # peak at the end of the 10% warm-up
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))  # then never increases
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01)
    assert warmup_cosine_lr(0, 1, 1e-3) == pytest.approx(1e-3)
    assert all(math.isfinite(x) and x > 0 for x in lrs)


def test_cosine_without_warm_up_starts_at_the_peak_and_ends_at_the_floor():
    lrs = [warmup_cosine_lr(i, 60, 3e-4, warmup_frac=0.0) for i in range(60)]
    assert lrs[0] == pytest.approx(3e-4) and lrs[-1] == pytest.approx(3e-5, rel=0.01)
    assert all(a >= b for a, b in itertools.pairwise(lrs))
    with pytest.raises(ValueError, match="--lr-schedule"):
        TrainConfig(lr_schedule="linear")
    with pytest.raises(ValueError, match="--sft-lr-schedule"):
        TrainConfig(sft_lr_schedule="linear")


def test_compute_dtype_is_validated():
    assert TrainConfig().compute_dtype == "auto"
    assert compute_dtype(TrainConfig(compute_dtype="bfloat16")) == torch.bfloat16
    assert compute_dtype(TrainConfig(compute_dtype="float32")) == torch.float32
    assert TrainConfig(compute_dtype="float32").compute_dtype == "float32"
    with pytest.raises(ValueError, match="--compute-dtype"):
        TrainConfig(compute_dtype="float16")


def test_default_env_kwargs_apply_to_the_default_env_only():
    assert TrainConfig().env_kwargs == {"max_turns": 4, "expert_noise": 0.5,
                                      "invalid_penalty": 1.0}
    assert TrainConfig(env="prefixgym/Arithmetic-v0").env_kwargs == {}
    assert TrainConfig(env_kwargs={"high": 8}).env_kwargs == {"high": 8}


def test_the_starting_weights_are_evaluated_unless_they_are_a_presets_random_init(tmp_path):
    assert TrainConfig().eval_on_start is False  # tiny
    assert TrainConfig(model="small").eval_on_start is False
    assert TrainConfig(model=str(tmp_path)).eval_on_start is True  # a checkpoint directory
    assert TrainConfig(backend="tinker", model="Qwen/Qwen3-8B").eval_on_start is True
    assert TrainConfig(eval_on_start=True).eval_on_start is True
    assert TrainConfig(model=str(tmp_path), eval_on_start=False).eval_on_start is False


@pytest.mark.parametrize("fast", [True, False])
def test_auto_compute_dtype_is_bf16_only_where_bf16_is_native(monkeypatch, fast):
    monkeypatch.setattr(train_command, "has_fast_bf16", lambda device: fast)
    assert compute_dtype(TrainConfig()) == (torch.bfloat16 if fast else torch.float32)


def test_sft_stages_and_warm_up_are_validated():
    stages = [{"steps": 3, "env_kwargs": {"expert_tool_rate": 1.0}}, {"steps": 2}]
    config = TrainConfig(sft_steps=5, sft_stages=stages, sft_warmup=0.0)
    assert config.sft_stages == [stages[0], {"steps": 2, "env_kwargs": {}}]
    bad = {
        "cover 5 warm-start steps and --sft-steps is 4": {"sft_steps": 4, "sft_stages": stages},
        "stage 2 needs steps": {"sft_steps": 3, "sft_stages": [stages[0], {"steps": 0}]},
        "stage 1 has unknown keys \\['env'\\]": {"sft_steps": 3,
                                                 "sft_stages": [{"steps": 3, "env": "x"}]},
        "stage 1: env_kwargs must be an object": {
            "sft_steps": 3, "sft_stages": [{"steps": 3, "env_kwargs": [1]}]},
        "must be a list of stages": {"sft_stages": {"steps": 3}},
        "--sft-warmup must be in": {"sft_warmup": 1.0},
    }
    for message, kwargs in bad.items():
        with pytest.raises(ValueError, match=message):
            TrainConfig(**kwargs)


@pytest.mark.parametrize("field", ["lr", "sft_lr"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_learning_rate_that_is_not_a_finite_number_is_refused(field, value):
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=f"^{flag} must be a finite number, got {value}$"):
        TrainConfig(**{field: value})


def test_the_training_clients_settings_have_one_default_and_one_check():
    """`prefixgym train`'s flags of the engine trainer's settings start where the engine
    does and refuse what it refuses, in the flag's name."""
    from prefixgym.engine.trainer.options import TrainerOptions

    config, options = TrainConfig(), TrainerOptions()
    for name in ("nonfinite_update", "share_prefixes", "recompute_activations",
                 "router_aux_loss_coef"):
        assert getattr(config, name) == getattr(options, name), name
    for name, value, message in [
        ("nonfinite_update", "ignore", "must be one of skip, error, got 'ignore'"),
        ("router_aux_loss_coef", -1.0, "must be a finite number >= 0, got -1.0"),
    ]:
        with pytest.raises(ValueError, match=f"^--{name.replace('_', '-')} {message}$"):
            TrainConfig(**{name: value})
        with pytest.raises(ValueError, match=f"^{name} {message}$"):
            TrainerOptions(**{name: value})
