"""A command's error is one line: pydantic's report and multi-line messages included."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from prefixgym.cli.errors import error_line
from prefixgym.types import AdamParams


def test_a_validation_error_is_its_first_field_and_message() -> None:
    with pytest.raises(ValidationError) as one:
        AdamParams(learning_rate=float("inf"))
    assert error_line(one.value) == "learning_rate: must be finite, got inf"
    with pytest.raises(ValidationError) as two:
        AdamParams(learning_rate=-1.0, beta1=2.0)
    line = error_line(two.value)
    assert line.startswith("learning_rate: Input should be greater than") and "\n" not in line
    assert line.endswith(" (and 1 more)")


def test_any_other_error_has_its_lines_joined() -> None:
    assert error_line(ValueError("a.json: bad\n  at line 3\n")) == "a.json: bad; at line 3"
    assert error_line(OSError("disk full")) == "disk full"
    assert error_line(ValueError()) == "ValueError"
