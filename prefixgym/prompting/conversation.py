"""Conversation: a token sequence that only grows, built one segment at a time.

    conv = Conversation(tokenizer, system="...", tools=[lookup])  # Tools, functions, models
    prompt = conv.generation_prompt()            # history + assistant header
    conv.add_sampled(seq.tokens, stop_reason=seq.stop_reason)
    conv.add_tool_result("lookup", "42")         # or add_user(text), add_messages(obs)

1. The fixed prefix (system prompt + tool definitions) is rendered first, once; the
   same config gives the same tokens in every episode and process, so every episode
   of a run shares one cacheable prefix.
2. Each user or tool message is rendered to tokens by the chat format and appended.
3. A sampled reply is appended as the exact ids the sampler returned -- they are
   never decoded and re-encoded, because the text of a reply can encode to other ids.
   When a reply did not end on the end-of-turn token (a stop string or max_tokens),
   the format's closing tokens are appended after it and the segment says so. Tokens
   the prompt made the reply begin with (`forced`: a tool call's opening) go between
   header and reply, never sampled; the reply's text includes them.
4. Each generation prompt is checked to extend the previous prompt + the reply
   sampled from it: `extension_ok`, `first_divergence`. With appends only this holds
   by construction; it fails when a reply is added for a prompt other than the last
   one issued (e.g. a message was added in between), which the check makes visible.

`segments` tiles `tokens`: the prefix, each message, and for each assistant turn its
header, its forced opening if any, its reply (`sampled=True` when sampled) and its
closing. Training weights belong on `sampled` segments (RL) or `kind == "reply"`
segments (SFT).

This module knows tokens, texts and chat formats; it knows nothing of samplers,
caches or envs.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from transformers import PreTrainedTokenizerBase

from prefixgym.prompting.chat_format import ChatFormat
from prefixgym.prompting.format_choice import (
    chat_format_for,
    make_chat_format,
    mismatch_lines,
    use_chat_format,
)
from prefixgym.prompting.tools import Tool, ToolLike, as_tools
from prefixgym.types import ModelInput

__all__ = [  # the format choice is format_choice.py's, imported from here too
    "Conversation",
    "Segment",
    "SegmentKind",
    "StopReasonArg",
    "chat_format_for",
    "make_chat_format",
    "mismatch_lines",
    "use_chat_format",
]

SegmentKind = Literal["prefix", "message", "header", "forced", "reply", "closing"]
StopReasonArg = Literal["stop", "length"] | None


@dataclass(frozen=True)
class Segment:
    """Tokens [start, end) of a conversation, and where they came from."""

    role: str
    start: int
    end: int
    sampled: bool = False
    closing_added: bool = False  # a reply that did not end on the end-of-turn token
    kind: SegmentKind = "message"
    stop_reason: str | None = None

    @property
    def length(self) -> int:
        return self.end - self.start


class Conversation:
    """One episode's tokens: fixed prefix, then appended messages and sampled replies."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        system: str | None = None,
        tools: Sequence[ToolLike] = (),
        chat_format: ChatFormat | None = None,
        chat_template: str | None = None,
    ) -> None:
        if chat_format is not None and chat_template is not None:
            raise ValueError("give chat_format or chat_template, not both")
        if system is not None and not isinstance(system, str):
            raise ValueError(f"system must be a str or None, got {type(system).__name__}")
        # a typed function or a pydantic model class becomes a Tool exactly as @tool makes it
        self.tools: list[Tool] = as_tools(tools)
        self.tokenizer = tokenizer
        self.format: ChatFormat = chat_format or chat_format_for(tokenizer, chat_template)
        self.system = system
        self._vocab_size = len(tokenizer)
        self._tokens: list[int] = []
        self._segments: list[Segment] = []
        self._history: list[dict[str, str]] = []  # what an HF template renders
        self._issued_prompt: list[int] | None = None  # last prompt handed out, unanswered
        self._expected_prefix: list[int] | None = None  # last prompt + its sampled reply
        self._first_divergence: int | None = None
        # 1) the fixed prefix, rendered once
        prefix = self.format.render_fixed_prefix(system, self.tools)
        self._fixed_prefix_len = len(prefix)
        self._append(prefix, "system", "prefix")
        if system is not None:
            self._history.append({"role": "system", "content": system})

    # -- reading --------------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def fixed_prefix(self) -> list[int]:
        return self._tokens[: self._fixed_prefix_len]

    @property
    def segments(self) -> list[Segment]:
        return list(self._segments)

    @property
    def stop_token_ids(self) -> list[int]:
        """Token ids that end an assistant turn; pass them to SamplingParams.stop_token_ids."""
        return self.format.stop_token_ids

    @property
    def messages(self) -> list[dict[str, str]]:
        """Decoded view: {"role", "content"} per message ("name" too for tool results)."""
        return [dict(m) for m in self._history]

    @property
    def extension_ok(self) -> bool:
        return self._first_divergence is None

    @property
    def first_divergence(self) -> int | None:
        """Index of the first token where a prompt broke from the previous prompt + reply."""
        return self._first_divergence

    @property
    def last_reply_text(self) -> str:
        """The text of the last assistant reply (its forced opening included), without
        its end-of-turn token."""
        for i in range(len(self._segments) - 1, -1, -1):
            seg = self._segments[i]
            if seg.kind == "reply":
                forced = i > 0 and self._segments[i - 1].kind == "forced"
                start = self._segments[i - 1].start if forced else seg.start
                return self._reply_text(self._tokens[start : seg.end])
        raise ValueError("the conversation has no assistant reply yet")

    def fork(self) -> Conversation:
        """A copy that grows on its own from here (the format and tokenizer are shared):
        two continuations of one conversation, e.g. the replies of an `n > 1` request."""
        twin = copy.copy(self)
        twin._tokens, twin._segments = list(self._tokens), list(self._segments)
        twin._history = [dict(m) for m in self._history]
        twin.tools = list(self.tools)
        for name in ("_issued_prompt", "_expected_prefix"):
            value = getattr(self, name)
            setattr(twin, name, None if value is None else list(value))
        return twin

    # -- building ---------------------------------------------------------------------

    def add_user(self, text: str) -> None:
        self.add_message("user", text)

    def add_tool_result(self, name: str, content: str) -> None:
        """Append a tool's result; `name` is the tool's name ("" renders no name)."""
        if not isinstance(name, str):
            raise ValueError(f"tool result name must be a str, got {name!r}")
        self.add_message("tool", content, name=name or None)

    def add_messages(self, messages: Iterable[Mapping[str, str]]) -> None:
        """Append an env's observation: `{"role", "content"}` dicts (tool results also
        carry their tool's "name"; a missing or empty name renders none)."""
        for m in messages:
            if m["role"] == "tool":
                self.add_tool_result(m.get("name", ""), m["content"])
            else:
                self.add_message(m["role"], m["content"])

    def add_message(self, role: str, content: str, name: str | None = None) -> None:
        """Append a rendered user, tool or (mid-conversation) system message."""
        # 2) render the new message against the history, then append it
        tokens = self.format.render_message(role, content, name, history=self._history,
                                            tools=self.tools)
        self._append(tokens, role, "message")
        message = {"role": role, "content": content}
        if name:
            message["name"] = name
        self._history.append(message)

    def generation_prompt(self) -> ModelInput:
        """History + assistant header: the prompt for the next assistant turn."""
        header = self.format.generation_header(history=self._history, tools=self.tools)
        prompt = self._tokens + header
        if self._expected_prefix is not None and self._first_divergence is None:
            self._first_divergence = _divergence(self._expected_prefix, prompt)
        self._issued_prompt = prompt
        return ModelInput.from_ints(prompt)

    def add_sampled(self, tokens: Sequence[int], stop_reason: StopReasonArg = None,
                    forced: Sequence[int] = ()) -> None:
        """Append a sampled reply exactly as sampled, then whatever closes the turn.
        `forced`: the ids the prompt had after the generation header (the reply was
        sampled after them), appended before it as prompt tokens."""
        sampled = self._validated_ids(tokens)
        forced_ids = self._validated_ids(forced)
        if stop_reason not in (None, "stop", "length"):
            raise ValueError(f"stop_reason must be 'stop', 'length' or None, got {stop_reason!r}")
        # 3) header (if this turn's prompt was not issued, it is the one it would be),
        #    the sampled ids verbatim, then the closing
        header = self.format.generation_header(history=self._history, tools=self.tools)
        prompt = self._tokens + header
        if self._issued_prompt is not None:
            self._expected_prefix = self._issued_prompt + forced_ids + sampled
        else:
            self._expected_prefix = prompt + forced_ids + sampled
        self._issued_prompt = None
        self._add_reply(header, sampled, sampled=True, stop_reason=stop_reason,
                        forced=forced_ids)

    def encode_reply(self, text: str) -> list[int]:
        """The ids a reply with this text would have if sampled: text + end-of-turn token.

        Reads the conversation, changes nothing; `add_sampled(encode_reply(text))`
        records an expert's reply as if it had been sampled."""
        return self.format.render_reply(text, history=self._history, tools=self.tools)

    def add_assistant(self, text: str) -> None:
        """Append a written (not sampled) assistant reply, e.g. an expert's, for SFT."""
        header = self.format.generation_header(history=self._history, tools=self.tools)
        reply = self.format.render_reply(text, history=self._history, tools=self.tools)
        self._issued_prompt = None
        self._add_reply(header, reply, sampled=False, stop_reason=None)

    # -- internals ------------------------------------------------------------------

    def _add_reply(
        self, header: list[int], reply: list[int], sampled: bool, stop_reason: str | None,
        forced: list[int] | None = None,
    ) -> None:
        last = reply[-1] if reply else None
        ended_on_stop = last is not None and last in self.format.stop_token_ids
        closing = self.format.end_of_turn(last if ended_on_stop else None)
        ended_on_end_of_turn = ended_on_stop and last == self.format.end_of_turn_token_id
        closing_added = bool(closing) and not ended_on_end_of_turn
        self._append(header, "assistant", "header")
        self._append(forced or [], "assistant", "forced")
        start = len(self._tokens)
        self._tokens.extend(reply)
        self._segments.append(Segment("assistant", start, len(self._tokens), sampled=sampled,
                                      closing_added=closing_added, kind="reply",
                                      stop_reason=stop_reason))
        self._append(closing, "assistant", "closing")
        self._history.append({"role": "assistant",
                              "content": self._reply_text([*(forced or []), *reply])})

    def _append(self, tokens: list[int], role: str, kind: SegmentKind) -> None:
        if not tokens:
            return
        start = len(self._tokens)
        self._tokens.extend(tokens)
        self._segments.append(Segment(role, start, len(self._tokens), kind=kind))

    def _reply_text(self, reply: list[int]) -> str:
        if reply and reply[-1] in self.format.stop_token_ids:
            reply = reply[:-1]
        return str(self.tokenizer.decode(reply, skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False))

    def _validated_ids(self, tokens: Sequence[int]) -> list[int]:
        if isinstance(tokens, (str, bytes)):
            raise ValueError("sampled tokens must be a sequence of int ids, got text")
        ids: list[int] = []
        for i, t in enumerate(tokens):
            try:
                t = operator.index(t)  # ints, and numpy/torch integer scalars
            except TypeError:
                raise ValueError(f"sampled tokens[{i}] is {t!r}; token ids are ints") from None
            if isinstance(t, bool):
                raise ValueError(f"sampled tokens[{i}] is {t!r}; token ids are ints")
            ids.append(t)
            if not 0 <= t < self._vocab_size:
                raise ValueError(
                    f"sampled tokens[{i}] = {t} is outside the tokenizer's vocabulary "
                    f"[0, {self._vocab_size})"
                )
        return ids


def _divergence(expected_prefix: list[int], prompt: list[int]) -> int | None:
    """First index where `prompt` does not continue `expected_prefix`; None if it does."""
    for i, (a, b) in enumerate(zip(expected_prefix, prompt)):
        if a != b:
            return i
    if len(prompt) < len(expected_prefix):
        return len(prompt)
    return None
