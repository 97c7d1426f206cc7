"""Wire types refuse what they cannot take as given: token ids are strict ints."""

from __future__ import annotations

import pytest

from prefixgym.types import ModelInput


@pytest.mark.parametrize("tokens", [[True, 2], ["7"], [7.0], [1, None], [-1]])
def test_model_input_refuses_ids_that_are_not_plain_ints(tokens: list[object]) -> None:
    with pytest.raises(ValueError, match="tokens"):
        ModelInput(tokens=tokens)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tokens"):
        ModelInput.from_ints(tokens)  # type: ignore[arg-type]


def test_model_input_keeps_plain_ints() -> None:
    assert ModelInput(tokens=[0, 7, 4095]).to_ints() == [0, 7, 4095]
