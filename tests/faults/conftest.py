"""Fixtures of the fault suite: one finished tiny run, and fresh copies of it to damage.
Every test here is marked `faults` (`pytest -m "not faults"` leaves the suite out)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from faultkit import TINY, assert_complete

from prefixgym.cli import main


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.faults)


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("faults") / "run"
    assert main(["train", "--out", str(out), *TINY]) == 0
    assert_complete(out)
    return out


@pytest.fixture
def run_copy(finished_run: Path, tmp_path: Path) -> Callable[[], Path]:
    def copy() -> Path:
        out = tmp_path / "run"
        shutil.copytree(finished_run, out)
        return out

    return copy
