"""What the agent-program tests share: the built-in tokenizer and one gateway per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from prefixgym.prompting.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer()


@pytest.fixture(scope="module")
def gateway() -> Iterator[object]:
    pytest.importorskip("uvicorn")
    from prefixgym.serving.agent_gateway import AgentGateway

    gw = AgentGateway("policy", api_key="secret")
    yield gw
    gw.stop()
