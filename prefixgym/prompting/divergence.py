"""Where two sequences part, and what the text around that point looks like.

Shared by the template probe and the trace replay: the first diverging index of two
strings or token lists, whether a text difference is only whitespace, and whether
the text at a divergence is volatile (a timestamp, UUID or counter). Knows nothing
of templates, tokenizers or caches.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

CONTEXT_BEFORE = 30
CONTEXT_AFTER = 50


def common_prefix_len(a: Sequence[T], b: Sequence[T]) -> int:
    """Length of the longest common prefix of two sequences (strings or token lists)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def first_divergence(a: Sequence[T], b: Sequence[T]) -> int | None:
    """Index where `b` stops extending `a`, or None when `a` is a prefix of `b`."""
    i = common_prefix_len(a, b)
    return None if i == len(a) else i


def context_window(text: str, at: int) -> tuple[str, int]:
    """A slice of `text` around `at` and the offset of `at` inside that slice."""
    start = max(0, at - CONTEXT_BEFORE)
    return text[start : at + CONTEXT_AFTER], at - start


def is_whitespace_change(left: str, right: str, at: int, span: int = 40) -> bool:
    """True when the texts differ at `at` by whitespace alone, for `span` visible characters."""
    a, b = left[at:], right[at:]
    if not (a[:1].isspace() or b[:1].isspace()):
        return False
    squeeze_a = re.sub(r"\s+", "", a)[:span]
    squeeze_b = re.sub(r"\s+", "", b)[:span]
    n = min(len(squeeze_a), len(squeeze_b))
    return squeeze_a[:n] == squeeze_b[:n]


_MONTHS = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"
VOLATILE_PATTERNS: dict[str, re.Pattern[str]] = {
    "uuid": re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"),
    "timestamp": re.compile(r"\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?Z?)?"),
    "date": re.compile(rf"\d{{1,2}} (?:{_MONTHS})[a-z]* \d{{4}}|(?:{_MONTHS})[a-z]* \d{{1,2}},? \d{{4}}"),
    "clock time": re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?\b"),
    "unix time": re.compile(r"\b1\d{9}(?:\.\d+)?\b"),
    "hex id": re.compile(r"\b[0-9a-f]{16,}\b"),
}


def _spanning(pattern: re.Pattern[str], text: str, at: int) -> bool:
    return any(m.start() <= at < max(m.end(), m.start() + 1) for m in pattern.finditer(text))


def volatile_kind(left: str, right: str, at: int) -> str | None:
    """Name of the volatile content that `left` and `right` differ in at `at`, if any.

    A regex match that spans the divergence on either side counts; so does a run of
    digits that differs while the text after it agrees (a counter).
    """
    for kind, pattern in VOLATILE_PATTERNS.items():
        if _spanning(pattern, left, at) or _spanning(pattern, right, at):
            return kind
    if at < len(left) and at < len(right) and left[at].isdigit() and right[at].isdigit():
        tail_a = re.sub(r"^\d+", "", left[at:])[:8]
        tail_b = re.sub(r"^\d+", "", right[at:])[:8]
        if tail_a == tail_b:
            return "counter"
    return None
