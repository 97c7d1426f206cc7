"""Gymnasium spaces for text: `AnyText` and the observation space of message tuples.

`gymnasium.spaces.Text` only contains strings over its charset (alphanumerics by
default), so an assistant reply with a space or a comma would be "outside" it.
`AnyText` contains every `str` up to a maximum length; it samples short printable
strings so that `check_env` and random policies stay cheap.

Vector envs: `gymnasium.vector.SyncVectorEnv` works as is. `AsyncVectorEnv` needs
`shared_memory=False`: a tuple of messages has no fixed shape, so it cannot live in
shared memory (gymnasium raises a TypeError that says so); observations are then
pickled between processes.

This module knows nothing of envs, tools or tokens.
"""

from __future__ import annotations

import string

import numpy as np
from gymnasium import spaces
from numpy.typing import NDArray

PRINTABLE = string.ascii_letters + string.digits + string.punctuation + " "
MAX_TEXT_LENGTH = 10_000_000
MESSAGE_KEYS = ("role", "name", "content")


class AnyText(spaces.Text):
    """Any `str` of `min_length`..`max_length` characters.

    `sample()` draws printable ASCII of at most `sample_max_length` characters."""

    def __init__(
        self,
        max_length: int = MAX_TEXT_LENGTH,
        *,
        min_length: int = 0,
        sample_max_length: int = 64,
        seed: int | np.random.Generator | None = None,
    ) -> None:
        super().__init__(max_length, min_length=min_length, charset=PRINTABLE, seed=seed)
        self.sample_max_length = max(min_length, min(sample_max_length, max_length))

    def contains(self, x: object) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def sample(
        self,
        mask: tuple[int | None, NDArray[np.int8] | None] | None = None,
        probability: tuple[int | None, NDArray[np.float64] | None] | None = None,
    ) -> str:
        if mask is None and probability is None:
            length = int(self.np_random.integers(self.min_length, self.sample_max_length + 1))
            mask = (length, None)
        return super().sample(mask=mask, probability=probability)

    def __repr__(self) -> str:
        return f"AnyText({self.min_length}, {self.max_length})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, AnyText)
            and self.min_length == other.min_length
            and self.max_length == other.max_length
        )


def message_space(max_length: int = MAX_TEXT_LENGTH) -> spaces.Dict:
    """One message: {"role": "user" | "tool", "name": str, "content": str}."""
    return spaces.Dict({key: AnyText(max_length) for key in MESSAGE_KEYS})


def messages_space(max_length: int = MAX_TEXT_LENGTH) -> spaces.Sequence:
    """A tuple of messages (possibly empty): an env's observation."""
    return spaces.Sequence(message_space(max_length), stack=False)
