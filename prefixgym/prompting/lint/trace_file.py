"""Read a rollout trace: JSONL, one sampling request per line.

Line format (docs/files.md): {"episode_id", "group_id", "turn", "prompt_tokens": [...],
"completion_tokens": [[...], ...], "num_samples", "include_prompt_logprobs",
"usage": {...}}. Only `prompt_tokens` is required. Every problem is a
`LintInputError` naming the file, the line and the field: a line nested too deeply
to parse, a usage count that is not a non-negative integer. Knows nothing of caches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from prefixgym.prompting.findings import LintInputError
from prefixgym.types import JSONObject

USAGE_COUNTS = ("prefill_computed_tokens", "prefill_cached_tokens", "sampled_tokens",
                "train_computed_tokens", "train_loss_tokens")


@dataclass
class TraceRequest:
    line: int
    episode_id: str | None
    group_id: str | None
    turn: int
    prompt_tokens: list[int]
    completion_tokens: list[list[int]]
    num_samples: int
    include_prompt_logprobs: bool
    usage: JSONObject = field(default_factory=dict)


def _token_list(value: object, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise LintInputError(f"{where} must be a list of integer token ids")
    if any(t < 0 for t in value):
        raise LintInputError(f"{where} holds a negative token id")
    return value


def _optional_id(value: object) -> str | None:
    return None if value is None else str(value)


def parse_request(obj: object, where: str, line: int) -> TraceRequest:
    """Validate one decoded JSON line; `where` prefixes every error message."""
    if not isinstance(obj, dict):
        raise LintInputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "prompt_tokens" not in obj:
        raise LintInputError(f"{where}: missing field 'prompt_tokens'")
    prompt = _token_list(obj["prompt_tokens"], f"{where}: 'prompt_tokens'")
    completions = obj.get("completion_tokens") or []
    if not isinstance(completions, list):
        raise LintInputError(f"{where}: 'completion_tokens' must be a list of token lists")
    if completions and all(isinstance(t, int) for t in completions):
        completions = [completions]  # one sample written flat
    completions = [_token_list(c, f"{where}: 'completion_tokens'[{i}]") for i, c in enumerate(completions)]
    turn = obj.get("turn", 0)
    num_samples = obj.get("num_samples", max(1, len(completions)))
    if not isinstance(turn, int) or isinstance(turn, bool) or turn < 0:
        raise LintInputError(f"{where}: 'turn' must be a non-negative integer, got {turn!r}")
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise LintInputError(f"{where}: 'num_samples' must be a positive integer, got {num_samples!r}")
    usage = obj.get("usage") or {}
    if not isinstance(usage, dict):
        raise LintInputError(f"{where}: 'usage' must be an object")
    for key in USAGE_COUNTS:
        count = usage.get(key, 0)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise LintInputError(f"{where}: 'usage'.{key} must be a non-negative integer, got "
                                 f"{count!r}")
    return TraceRequest(
        line=line,
        episode_id=_optional_id(obj.get("episode_id")),
        group_id=_optional_id(obj.get("group_id")),
        turn=turn,
        prompt_tokens=prompt,
        completion_tokens=completions,
        num_samples=num_samples,
        include_prompt_logprobs=bool(obj.get("include_prompt_logprobs", False)),
        usage=usage,
    )


def load_trace(path: str | Path) -> list[TraceRequest]:
    """All requests of a JSONL trace, in file order; blank lines are skipped."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LintInputError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LintInputError(f"{p}: cannot read: {exc}") from None
    requests = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise LintInputError(f"{p}:{number}: invalid JSON: {exc.msg} (column {exc.colno})") from None
        except RecursionError:
            raise LintInputError(f"{p}:{number}: JSON nested too deeply to read") from None
        except ValueError as exc:  # e.g. an integer of more than 4300 digits
            raise LintInputError(f"{p}:{number}: invalid JSON: {exc}") from None
        requests.append(parse_request(obj, f"{p}:{number}", number))
    if not requests:
        raise LintInputError(f"{p}: the trace holds no requests")
    return requests
