"""The real-model tests' conversions are read from (and, if missing, written to)
.real-models/cache: `PREFIXGYM_CACHE_DIR` for these tests only (real_checkpoints.py
says which models, and how they get here)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from real_checkpoints import MODELS_DIR

from prefixgym.files import CACHE_VARIABLE


@pytest.fixture(scope="session", autouse=True)
def real_model_cache() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_VARIABLE, str(MODELS_DIR / "cache"))
        yield
