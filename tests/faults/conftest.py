"""Fixtures of the fault suite: one finished tiny run, and fresh copies of it to damage.
Every test here is marked `faults` (`pytest -m "not faults"` leaves the suite out).
Runs in this process write no plots (tests/trainer holds those; here they were a third
of each finished run's time).

Under pytest-xdist a session fixture is built once per worker, so `finished_run` may be
trained twice (once per worker that runs one of its users: about 8 s each on an idle
CI machine). Keeping its users on one worker would take `--dist loadgroup`, which with
pytest 9.2 and pytest-xdist 3.8 groups nothing (pytest-xdist issue #1386), or
`--dist loadfile`, which would not group the users in three files either and balances
the suite worse."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from faultkit import TINY, assert_complete

import prefixgym.trainer.run as run_module
from prefixgym.cli import main


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.faults)


def no_plots(out: Path, records: object) -> list[Path]:
    return []


@pytest.fixture(autouse=True)
def _no_plots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_module, "write_plots", no_plots)


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("faults") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_module, "write_plots", no_plots)
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
