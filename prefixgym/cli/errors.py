"""An error as the one line a command prints: `prefixgym COMMAND: LINE`, exit 2.

Most errors already read as one line naming the file, flag or field. Two kinds do not:
pydantic's ValidationError (a header, then a block per problem with a link), and a
message that quotes input across lines. This module knows nothing of the commands.
"""

from __future__ import annotations

__all__ = ["error_line"]


def error_line(error: BaseException) -> str:
    """`error` in one line: pydantic's first problem as `field: message`, anything else
    with its lines joined by '; '."""
    errors = getattr(error, "errors", None)
    if callable(errors) and type(error).__name__ == "ValidationError":
        problems = errors()
        first = problems[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "value"
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return f"{where}: {message}{more}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines) or type(error).__name__
