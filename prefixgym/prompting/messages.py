"""What a rendered chat message is, and the checks every chat format applies to one.

A `Message` is a `{"role", "content"[, "name"]}` mapping; `MESSAGE_ROLES` are the
roles a format renders as messages (assistant turns are sampled or written as
replies). `check_role` and `check_text` refuse anything else with a ValueError that
names the field. This module knows nothing of tokens, templates or conversations.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["MESSAGE_ROLES", "Message", "check_role", "check_text"]

Message = Mapping[str, str]
MESSAGE_ROLES = ("system", "user", "tool")  # roles of rendered (non-assistant) messages


def check_role(role: str) -> None:
    if role not in MESSAGE_ROLES:
        raise ValueError(
            f"role {role!r} cannot be rendered as a message; use one of {MESSAGE_ROLES} "
            "(assistant turns are sampled or written with add_assistant)"
        )


def check_text(field: str, value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{field} must be a str, got {type(value).__name__}")
    return value
