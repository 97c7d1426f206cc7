"""How one chat message becomes a segment of tokens.

A conversation is built by appending segments, never by re-rendering history, so a
chat format answers per-message questions:

- `render_fixed_prefix(system, tools)`: the system prompt and tool definitions,
  rendered first and once;
- `render_message(role, content, name)`: a user, tool (or later system) message;
- `generation_header()`: what opens an assistant turn (`<|im_start|>assistant\\n`);
- `end_of_turn(after_token)`: what closes an assistant turn. With `after_token=None`,
  the whole closing a reply needs when it did not end on a stop token (it hit a stop
  string or max_tokens): `<|im_end|>\\n`. After a reply that ended on the end-of-turn
  token: the rest, `\\n`;
- `render_reply(text)`: a written (not sampled) assistant reply, for expert turns.

Two formats implement this protocol. `ChatMLFormat` is the built-in one (the built-in
tokenizer's ChatML, or any tokenizer with `<|im_start|>`/`<|im_end|>` tokens); it
encodes message text as plain text, so a message cannot forge a special token.
`HFTemplateFormat` (in `hf_template.py`, re-exported here with
`TemplateNotAppendOnlyError` and `hf_tools`) adapts any Hugging Face Jinja chat
template by rendering the conversation with and without the new message and
tokenizing the text difference; it refuses templates that are not append-only.

The keyword arguments `history` (the messages so far, as `{"role", "content"[,
"name"]}` dicts, a system message first) and `tools` are what the HF adapter renders
around the new message; the built-in format ignores them.

This module knows tokens and text; it keeps no conversation state and knows nothing
of sampling, caches or envs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from prefixgym.prompting.hf_template import (  # re-exported: the second ChatFormat
    HFTemplateFormat,
    TemplateNotAppendOnlyError,
    hf_tools,
)
from prefixgym.prompting.messages import MESSAGE_ROLES, Message, check_role, check_text
from prefixgym.prompting.tools import ToolLike, tools_json

__all__ = [
    "MESSAGE_ROLES",
    "TOOLS_INTRO",
    "ChatFormat",
    "ChatMLFormat",
    "HFTemplateFormat",
    "Message",
    "TemplateNotAppendOnlyError",
    "hf_tools",
]

TOOLS_INTRO = (
    "# Tools\n"
    'Call a tool by writing <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
    " Available tools:\n"
)


@runtime_checkable
class ChatFormat(Protocol):
    """Turns messages into token segments that are appended to a conversation."""

    @property
    def stop_token_ids(self) -> list[int]: ...

    @property
    def end_of_turn_token_id(self) -> int | None: ...

    def render_fixed_prefix(self, system: str | None, tools: Sequence[ToolLike]) -> list[int]: ...

    def render_message(
        self, role: str, content: str, name: str | None = None, *,
        history: Sequence[Message] = (), tools: Sequence[ToolLike] = (),
    ) -> list[int]: ...

    def generation_header(
        self, *, history: Sequence[Message] = (), tools: Sequence[ToolLike] = ()
    ) -> list[int]: ...

    def end_of_turn(self, after_token: int | None = None) -> list[int]: ...

    def render_reply(
        self, text: str, *, history: Sequence[Message] = (), tools: Sequence[ToolLike] = ()
    ) -> list[int]: ...


def _special_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id or token_id < 0:
        raise ValueError(f"tokenizer has no {token!r} token, which the ChatML format needs")
    return token_id


class ChatMLFormat:
    """The built-in format: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message.

    Tool messages open with `<|im_start|>tool name={name}\\n`. The system message
    carries the tool definitions (`tools_json`). It renders, token for token, what the
    built-in chat template renders for the same conversation, for text that holds no
    special-token strings (here those are plain text; the template makes them special).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.im_start = _special_id(tokenizer, "<|im_start|>")
        self.im_end = _special_id(tokenizer, "<|im_end|>")
        eos = tokenizer.eos_token_id
        self._stop_ids = [self.im_end] + ([eos] if isinstance(eos, int) and eos != self.im_end
                                          else [])
        # A private copy that encodes special-token strings as plain text, so that
        # message content cannot forge `<|im_end|>` (and the shared tokenizer is untouched).
        self._plain = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        self._plain.encode_special_tokens = True
        self._newline = self.encode_plain("\n")
        self._header = [self.im_start, *self.encode_plain("assistant\n")]
        self._prefix_cache: dict[tuple[str | None, str], list[int]] = {}

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self._stop_ids)

    @property
    def end_of_turn_token_id(self) -> int:
        return self.im_end

    def encode_plain(self, text: str) -> list[int]:
        return list(self._plain.encode(text, add_special_tokens=False).ids)

    def _block(self, header_and_body: str) -> list[int]:
        return [self.im_start, *self.encode_plain(header_and_body), self.im_end, *self._newline]

    def render_fixed_prefix(self, system: str | None, tools: Sequence[ToolLike]) -> list[int]:
        if system is not None:
            check_text("system", system)
        schema = tools_json(list(tools)) if tools else ""
        key = (system, schema)
        if key not in self._prefix_cache:
            if system is None and not tools:
                tokens: list[int] = []
            else:
                body = system if system is not None else ""
                if tools:
                    sep = "\n\n" if system is not None else ""
                    body += f"{sep}{TOOLS_INTRO}<tools>\n{schema}\n</tools>"
                tokens = self._block("system\n" + body)
            if len(self._prefix_cache) > 64:
                self._prefix_cache.clear()
            self._prefix_cache[key] = tokens
        return list(self._prefix_cache[key])

    def render_message(
        self, role: str, content: str, name: str | None = None, *,
        history: Sequence[Message] = (), tools: Sequence[ToolLike] = (),
    ) -> list[int]:
        check_role(role)
        check_text("content", content)
        header = f"tool name={name}" if role == "tool" and name else role
        return self._block(f"{header}\n{content}")

    def generation_header(
        self, *, history: Sequence[Message] = (), tools: Sequence[ToolLike] = ()
    ) -> list[int]:
        return list(self._header)

    def end_of_turn(self, after_token: int | None = None) -> list[int]:
        if after_token == self.im_end:
            return list(self._newline)
        return [self.im_end, *self._newline]

    def render_reply(
        self, text: str, *, history: Sequence[Message] = (), tools: Sequence[ToolLike] = ()
    ) -> list[int]:
        return [*self.encode_plain(check_text("text", text)), self.im_end]
