"""No code from a model directory ever runs: a tokenizer whose config names its own
Python class (auto_map) is refused with one line, wherever a tokenizer is loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from prefixgym.cli.lint import main as lint_main
from prefixgym.local_service import LocalService
from prefixgym.prompting.build_tokenizer import ASSETS_DIR
from prefixgym.prompting.tokenizer import load_tokenizer, load_tokenizer_dir


@pytest.fixture
def remote_code_dir(tmp_path: Path) -> Path:
    """A tokenizer directory whose tokenizer_config.json asks for its own class, in a
    module that leaves a mark when it is imported."""
    directory = tmp_path / "model"
    directory.mkdir()
    shutil.copy(ASSETS_DIR / "tokenizer.json", directory)
    config = json.loads((ASSETS_DIR / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "MarkingTokenizer"
    config["auto_map"] = {"AutoTokenizer": ["tokenization_mark.MarkingTokenizer",
                                            "tokenization_mark.MarkingTokenizer"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "tokenization_mark.py").write_text(
        f"open({str(tmp_path / 'RAN')!r}, 'w').write('the directory ran code')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class MarkingTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    return directory


def test_loading_it_is_refused_and_runs_nothing(remote_code_dir: Path) -> None:
    for load in (load_tokenizer, load_tokenizer_dir):
        with pytest.raises(ValueError, match="would run Python code from that directory"):
            load(remote_code_dir)
    with pytest.raises(ValueError, match="would run Python code"):
        LocalService(model="tiny", tokenizer=str(remote_code_dir))
    assert not (remote_code_dir.parent / "RAN").exists()


def test_lint_refuses_it_in_one_line(remote_code_dir: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"prompt_tokens": [1, 2, 3]}\n')
    assert lint_main(["trace", str(trace), "--tokenizer", str(remote_code_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert "would run Python code" in err and "\n" not in err
    assert not (remote_code_dir.parent / "RAN").exists()
