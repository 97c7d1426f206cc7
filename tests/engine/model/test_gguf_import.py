"""`--model FILE.gguf` without a real model (tests/real_models/ converts two): what
is refused, in one line, and that a file converted once is read from the cache."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from prefixgym.cli import main
from prefixgym.cli.proxy import tokenizer_for
from prefixgym.engine.model import gguf_import, load_model
from prefixgym.engine.model.gguf_import import CACHE_VARIABLE, SOURCE_FILE, checkpoint_dir_of
from prefixgym.local_service import LocalService
from prefixgym.serving.config import ServeConfig


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_missing_file_is_refused_by_each_loader(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.gguf")
    for load in (checkpoint_dir_of, load_model, LocalService, tokenizer_for):
        with pytest.raises(ValueError, match=r"missing\.gguf: no such GGUF file"):
            load(missing)


def test_a_file_that_is_not_gguf_is_refused_before_any_conversion(tmp_path: Path,
                                                                  cache: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"PK\x03\x04 a zip, renamed")
    with pytest.raises(ValueError, match=r"model\.gguf: not a GGUF file"):
        checkpoint_dir_of(tmp_path / "model.gguf")
    assert not cache.exists()


def test_without_the_gguf_package_the_error_says_what_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ValueError, match=r"needs the gguf package: pip install "
                                         r"'prefixgym\[gguf\]'"):
        checkpoint_dir_of(tmp_path / "model.gguf")


def test_a_file_converted_once_is_read_from_the_cache_wherever_it_lies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    converted: list[Path] = []

    def convert(source: Path, digest: str, out: Path) -> None:
        converted.append(source)
        (out / SOURCE_FILE).write_text(digest)

    monkeypatch.setattr(gguf_import, "_convert", convert)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "model.gguf").write_bytes(b"GGUF and some weights")
    first = checkpoint_dir_of(tmp_path / "a" / "model.gguf")
    (tmp_path / "a" / "model.gguf").rename(tmp_path / "model.gguf")  # moved: same bytes
    assert checkpoint_dir_of(tmp_path / "model.gguf") == first
    (tmp_path / "model.gguf").write_bytes(b"GGUF and other weights")  # changed: converted again
    assert checkpoint_dir_of(tmp_path / "model.gguf") != first
    assert len(converted) == 2 and first.name.startswith("model-")


def test_train_refuses_a_bad_chat_template_file_and_one_for_a_preset(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = ["--out", str(tmp_path / "run"), "--steps", "1"]
    assert main(["train", "--chat-template", str(tmp_path / "none.jinja"), *out]) == 2
    assert "--chat-template " + str(tmp_path / "none.jinja") + ": no such file" in (
        capsys.readouterr().err)
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert main(["train", "--chat-template", str(tmp_path / "t.jinja"), *out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("prefixgym train: --chat-template and --chat-template-kwargs apply "
                       "to a checkpoint's chat template; --model tiny uses the built-in format")


def test_serve_takes_a_chat_template_for_the_built_in_engine_only() -> None:
    assert ServeConfig(chat_template="t.jinja").chat_template == "t.jinja"
    with pytest.raises(ValueError, match="--chat-template is the built-in engine's"):
        ServeConfig(engine="vllm", chat_template="t.jinja")
