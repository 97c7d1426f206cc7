"""Bad input to the commands: one line on stderr, exit 2, nothing written. An --out
that cannot be written is found before the model loads; a broken model directory is
named with its file and field or tensor; a run without an intact checkpoint cannot be
rolled out."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from faultkit import TINY, fingerprint, hf_dir

import prefixgym.cli.train as train_command
from prefixgym.cli import main
from prefixgym.trainer.config import TrainConfig


def one_line_error(capsys: pytest.CaptureFixture[str], command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"prefixgym {command}: ") and "\n" not in err, err
    return err


@pytest.fixture
def no_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the bad input was found")

    monkeypatch.setattr(train_command, "LocalService", refuse)


def test_an_out_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               no_model_loads: None) -> None:
    out = tmp_path / "out"
    out.write_text("not a directory")
    assert main(["train", "--out", str(out), *TINY]) == 2
    assert "is a file, not a directory" in one_line_error(capsys, "train")
    assert out.read_text() == "not a directory"


def test_an_out_below_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                             no_model_loads: None) -> None:
    (tmp_path / "file").write_text("x")
    assert main(["train", "--out", str(tmp_path / "file" / "run"), *TINY]) == 2
    assert "is not a writable directory" in one_line_error(capsys, "train")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="Linux's sysfs")
def test_a_read_only_out(capsys: pytest.CaptureFixture[str], no_model_loads: None) -> None:
    """sysfs takes no new file from anyone, root included (a directory's mode does not
    stop root)."""
    out = Path("/sys/kernel")
    assert main(["train", "--out", str(out), *TINY]) == 2
    error = one_line_error(capsys, "train")
    assert f"{out} is not a writable directory: " in error
    assert error.endswith(("Permission denied", "Read-only file system")), error


@pytest.mark.parametrize(("config", "poison", "message"), [
    ({"hidden_size": [64]}, None, "config.json: field 'hidden_size' must be an integer, got [64]"),
    ({"rms_norm_eps": "small"}, None, "config.json: field 'rms_norm_eps' must be a number"),
    (None, "model.layers.0.mlp.up_proj.weight",
     "model.safetensors: tensor 'model.layers.0.mlp.up_proj.weight' holds NaN or inf"),
])
def test_a_broken_model_directory_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, object] | None,
    poison: str | None, message: str,
) -> None:
    model = hf_dir(tmp_path / "model", config, poison)
    out = tmp_path / "run"
    assert main(["train", "--model", str(model), "--out", str(out), *TINY]) == 2
    assert message in one_line_error(capsys, "train")
    assert list(out.iterdir()) == []  # checked writable, then nothing written


def test_rolling_out_a_run_without_an_intact_checkpoint(
    run_copy: Callable[[], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_copy()
    for manifest in (out / "checkpoints").glob("*/checkpoint.json"):
        manifest.write_text("")
    before = fingerprint(out)
    assert main(["rollout", "--run", str(out), "--groups", "1"]) == 2
    assert "no intact checkpoint under" in one_line_error(capsys, "rollout")
    assert fingerprint(out) == before


def test_a_trace_path_that_cannot_be_written(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rollout", "--trace", str(tmp_path), "--groups", "1"]) == 2  # a directory
    assert "Is a directory" in one_line_error(capsys, "rollout")


def test_nonfinite_update_reaches_the_training_client(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    run, service = train_command.build_run(TrainConfig(
        out=str(tmp_path / "run"), nonfinite_update="error", eval_episodes=1))
    try:
        assert run.training.nonfinite_update == "error"  # type: ignore[attr-defined]
    finally:
        service.close()
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--nonfinite-update", "ignore"])
    assert exit_info.value.code == 2
    assert "--nonfinite-update must be one of skip, error" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--lr", "--sft-lr", "--kl-coef", "--temperature"])
@pytest.mark.parametrize("value", ["inf", "nan"])
def test_a_non_finite_number_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_model_loads: None, flag: str,
    value: str,
) -> None:
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--out", str(out), flag, value])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        f"prefixgym train: error: {flag} must be a finite number, got {value}"
    assert not out.exists()
