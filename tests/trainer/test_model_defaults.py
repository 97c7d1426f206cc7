"""`prefixgym train --model DIR`: a checkpoint directory takes the pretrained-model
defaults for every setting no flag, --config file or resumed run's saved config gives,
says so in the run's first lines, and leaves the built-in presets' defaults alone."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
from tiny_checkpoints import save_tiny_qwen2

from prefixgym.cli import main
from prefixgym.cli.flags import field_docs
from prefixgym.cli.train_args import parse_train_args, parse_train_config
from prefixgym.trainer.config import RUN_CONFIG, TrainConfig
from prefixgym.trainer.model_defaults import (
    PRETRAINED_LORA_LR,
    PRETRAINED_LR,
    flag_value,
    pretrained_defaults_line,
)

FULL = {"lr": 3e-5, "sft_lr": 3e-5, "sft_steps": 0, "max_tokens": 64, "eval_episodes": 200}
TINY = {"lr": 6e-4, "sft_lr": 2e-3, "sft_steps": 400, "max_tokens": 8, "eval_episodes": 1500}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen2 model with the built-in tokenizer, as a local HF directory."""
    directory = tmp_path_factory.mktemp("ckpt")
    save_tiny_qwen2(directory)
    return str(directory)


def resolved(config: TrainConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in FULL}


def test_a_checkpoint_directory_takes_the_pretrained_defaults(checkpoint: str) -> None:
    config, taken = parse_train_args(["--model", checkpoint])
    assert resolved(config) == FULL and taken == FULL
    # what was not sized for tiny stays; the starting weights are evaluated
    assert (config.steps, config.groups_per_step, config.group_size) == (60, 16, 8)
    assert config.eval_on_start is True


def test_a_gguf_file_takes_the_pretrained_defaults(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF")  # a file by that name: not read here
    config, taken = parse_train_args(["--model", str(tmp_path / "model.gguf")])
    assert resolved(config) == FULL and taken == FULL and config.eval_on_start is True
    assert parse_train_args(["--model", str(tmp_path / "missing.gguf")])[1] == {}


def test_lora_takes_its_own_learning_rate(checkpoint: str) -> None:
    config = parse_train_config(["--model", checkpoint, "--lora-rank", "16"])
    assert config.lr == config.sft_lr == PRETRAINED_LORA_LR == 2e-4
    assert resolved(config) == {**FULL, "lr": 2e-4, "sft_lr": 2e-4}
    assert parse_train_config(["--model", checkpoint, "--lora-rank", "0"]).lr == PRETRAINED_LR


@pytest.mark.parametrize(("flag", "value", "name", "expected"), [
    ("--lr", "1e-4", "lr", 1e-4),
    ("--sft-lr", "1e-5", "sft_lr", 1e-5),
    ("--sft-steps", "20", "sft_steps", 20),
    ("--max-tokens", "8", "max_tokens", 8),  # a given value equal to tiny's default wins too
    ("--eval-episodes", "1500", "eval_episodes", 1500),
])
def test_each_given_flag_wins(checkpoint: str, flag: str, value: str, name: str,
                              expected: object) -> None:
    config, taken = parse_train_args(["--model", checkpoint, flag, value])
    assert resolved(config) == {**FULL, name: expected}
    assert name not in taken and len(taken) == len(FULL) - 1


def test_a_config_file_wins_and_flags_win_over_it(checkpoint: str, tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(f'model = "{checkpoint}"\nlr = 1e-4\nmax-tokens = 16\n')
    config, taken = parse_train_args(["--config", str(toml)])
    assert resolved(config) == {**FULL, "lr": 1e-4, "max_tokens": 16}
    assert set(taken) == {"sft_lr", "sft_steps", "eval_episodes"}
    config = parse_train_config(["--config", str(toml), "--max-tokens", "32"])
    assert (config.lr, config.max_tokens) == (1e-4, 32)


def test_a_recipe_on_a_checkpoint_keeps_what_the_recipe_sets(checkpoint: str) -> None:
    config = parse_train_config(["--config", "tools", "--model", checkpoint])
    recipe = parse_train_config(["--config", "tools"])
    assert (config.lr, config.sft_steps, config.max_tokens, config.eval_episodes) == (
        recipe.lr, recipe.sft_steps, recipe.max_tokens, recipe.eval_episodes)
    assert config.sft_lr == PRETRAINED_LR  # the recipe sets no --sft-lr: tiny's would break it


@pytest.mark.parametrize("argv", [[], ["--model", "small"], ["--env", "prefixgym/Arithmetic-v0"]])
def test_the_presets_keep_their_defaults(argv: list[str]) -> None:
    config, taken = parse_train_args(argv)
    assert resolved(config) == TINY and taken == {}
    assert resolved(TrainConfig()) == TINY  # (the dataclass's own defaults are tiny's)


def test_a_resumed_run_keeps_its_saved_values(checkpoint: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    saved = asdict(TrainConfig(model=checkpoint, out=str(out)))  # saved with tiny's defaults
    (out / RUN_CONFIG).write_text(json.dumps(saved))
    config, taken = parse_train_args(["--resume", "--out", str(out)])
    assert resolved(config) == TINY and taken == {}
    config = parse_train_config(["--resume", "--out", str(out), "--model", checkpoint,
                                 "--steps", "90"])
    assert resolved(config) == TINY and config.steps == 90
    # with nothing saved to continue from, the run is a new one: the defaults apply
    fresh = parse_train_config(["--resume", "--out", str(tmp_path / "new"), "--model",
                                checkpoint])
    assert resolved(fresh) == FULL


def test_an_agent_run_on_a_checkpoint_skips_the_warm_start_and_takes_the_rest(
        checkpoint: str, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"q": 1}\n')
    config = parse_train_config(["--model", checkpoint, "--agent", "x.py:fn", "--tasks",
                                 str(tasks)])
    assert resolved(config) == FULL


def test_help_says_each_pretrained_default() -> None:
    docs = field_docs(TrainConfig)
    for name, value in FULL.items():
        assert "checkpoint directory" in docs[name], name
        assert flag_value(value) in docs[name], (name, docs[name])
    assert flag_value(PRETRAINED_LORA_LR) in docs["lr"]
    assert flag_value(PRETRAINED_LORA_LR) in docs["sft_lr"]


def test_the_line_names_each_default_as_a_flag() -> None:
    assert pretrained_defaults_line(FULL) == (
        "pretrained-model defaults (--model is a pretrained checkpoint): --lr 3e-5, "
        "--sft-lr 3e-5, --sft-steps 0, --max-tokens 64, --eval-episodes 200 (flags and "
        "--config settings you give win; docs/models.md)")


def test_a_run_on_a_checkpoint_says_which_defaults_it_took(
        checkpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    argv = ["train", "--model", checkpoint, "--out", str(out), "--env", "tests/Lengthy-v0",
            "--steps", "1", "--groups-per-step", "1", "--group-size", "2",
            "--eval-episodes", "2", "--max-tokens", "4", "--no-progress"]
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    line = ("pretrained-model defaults (--model is a pretrained checkpoint): --lr 3e-5, "
            "--sft-lr 3e-5, --sft-steps 0 (flags and --config settings you give win; "
            "docs/models.md)")
    assert line in err
    first_of_run = next(i for i, text in enumerate(err) if ", training in " in text)
    assert err.index(line) < first_of_run  # before the run's own first line
    saved = json.loads((out / RUN_CONFIG).read_text())
    assert (saved["lr"], saved["sft_steps"], saved["max_tokens"]) == (3e-5, 0, 4)
