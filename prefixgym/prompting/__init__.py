"""prefixgym.prompting: where text becomes tokens: tokenizer, Conversation, chat formats,
tools, and the linter.

`tokenizer` loads the built-in BPE (or a local HF one); `Conversation` builds an
episode's tokens by appending segments; `chat_format` says how one message becomes
tokens; `tools` is text-level tool specs and call parsing; `lint` finds what makes
prompts miss the prefix cache. Knows nothing of models, samplers or envs. Importing
this package loads transformers (for tokenizers), not torch models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixgym.prompting.chat_format import (
        ChatFormat,
        ChatMLFormat,
        HFTemplateFormat,
        TemplateNotAppendOnlyError,
    )
    from prefixgym.prompting.conversation import Conversation, Segment, chat_format_for

_LAZY = {
    "Conversation": "prefixgym.prompting.conversation",
    "Segment": "prefixgym.prompting.conversation",
    "chat_format_for": "prefixgym.prompting.conversation",
    "ChatFormat": "prefixgym.prompting.chat_format",
    "ChatMLFormat": "prefixgym.prompting.chat_format",
    "HFTemplateFormat": "prefixgym.prompting.chat_format",
    "TemplateNotAppendOnlyError": "prefixgym.prompting.chat_format",
}

__all__ = [
    "ChatFormat",
    "ChatMLFormat",
    "Conversation",
    "HFTemplateFormat",
    "Segment",
    "TemplateNotAppendOnlyError",
    "chat_format_for",
]


def __getattr__(name: str) -> Any:
    # Lazy, so that `prefixgym.prompting.tools` (text only) imports without transformers.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prefixgym.prompting' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
