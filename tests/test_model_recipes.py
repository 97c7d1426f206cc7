"""The shipped recipes for pretrained models (`--config addition`, `--config addition3`)
run as `prefixgym train --config NAME --model PATH` says: on a tiny random-init Hugging
Face checkpoint (no download), with the recipe's env, kwargs and reply length, the
pretrained-model defaults for what the recipe leaves unset, and the flags winning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_checkpoints import save_tiny_qwen2

from prefixgym.cli import main
from prefixgym.recipes import recipe_names
from prefixgym.trainer.model_defaults import PRETRAINED_LR

REAL_MODEL_RECIPES = ["addition", "addition3"]
ONE_STEP = ["--steps", "1", "--groups-per-step", "1", "--group-size", "2",
            "--eval-episodes", "2", "--no-progress"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("ckpt")
    save_tiny_qwen2(directory)
    return str(directory)


@pytest.mark.parametrize("name", REAL_MODEL_RECIPES)
def test_a_real_model_recipe_trains_a_checkpoint(name: str, checkpoint: str,
                                                 tmp_path: Path) -> None:
    assert name in recipe_names()
    out = tmp_path / "run"
    assert main(["train", "--config", name, "--model", checkpoint, "--out", str(out),
                 *ONE_STEP]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["env"] == "prefixgym/Addition-v0" and saved["model"] == checkpoint
    assert (saved["lr"], saved["sft_steps"], saved["max_tokens"]) == (PRETRAINED_LR, 0, 16)
    assert saved["eval_on_start"] is True and saved["steps"] == 1
    evaluated = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                 if "eval/success" in line]
    assert [m["step"] for m in evaluated] == [0, 1]  # before training and at the end
    assert all(m["eval/episodes"] == 2 for m in evaluated)

