"""tinker-cookbook's recipes configure the logging module for their run
(`ml_log.configure_logging_module`: the root logger at INFO, its handlers replaced by a
console one and a file one in the test's tmp_path). Left in place, a later test in the
same worker that logs at INFO (tensorboard's reader does) writes through a file handler
whose directory pytest has removed, and fails; each test here gets the root logger back
as it found it."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def root_logger_restored() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)
