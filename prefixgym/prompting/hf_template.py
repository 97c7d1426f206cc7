"""The Hugging Face chat-template adapter: any Jinja chat template, one message at a time.

`HFTemplateFormat` implements the `ChatFormat` protocol (see `chat_format.py`) by
render-and-diff: it renders the conversation with and without the new message exactly
as transformers' `apply_chat_template(..., tokenize=False)` would, and tokenizes the
text difference. That only works for templates whose rendering of a conversation
extends the rendering of its beginning; the constructor probes the template with a
small conversation and raises `TemplateNotAppendOnlyError` (where, and why) for one
that is not.

This module knows templates, text and tokens; it keeps no conversation state and
knows nothing of the built-in ChatML format, sampling, caches or envs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from prefixgym.prompting.messages import Message, check_role, check_text
from prefixgym.prompting.tools import ToolLike, as_tools
from prefixgym.types import JSONObject

__all__ = ["HFTemplateFormat", "TemplateNotAppendOnlyError", "hf_tools"]


class TemplateNotAppendOnlyError(ValueError):
    """A chat template renders a longer conversation as something other than an extension."""

    def __init__(self, reason: str, index: int, earlier: str, later: str) -> None:
        self.reason = reason
        self.index = index
        lo = max(0, index - 40)
        self.earlier_text = earlier[lo : index + 40]
        self.later_text = later[lo : index + 40]
        super().__init__(
            f"chat template is not append-only: {reason}. First difference at character "
            f"{index}: the earlier rendering reads {self.earlier_text!r}, the later one reads "
            f"{self.later_text!r}. Building prompts by appending tokens would not match what "
            "the template renders; pass an append-only template (e.g. one that keeps past "
            "reasoning) or use the built-in format"
        )


def hf_tools(tools: Sequence[ToolLike]) -> list[JSONObject] | None:
    """Tools as Hugging Face chat templates expect them ({"type": "function", ...}); a
    function or a pydantic model class is converted as `@tool` / `Tool.from_model` do."""
    return [{"type": "function", "function": t.schema()} for t in as_tools(tools)] or None


_PROBE_SYSTEM = {"role": "system", "content": "You are a careful assistant."}
_PROBE_TURNS: list[dict[str, str]] = [
    {"role": "user", "content": "What is stored under key a?"},
    {"role": "assistant", "content": "<think>\nI should look it up.\n</think>\n\n"
     '<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'},
    {"role": "tool", "name": "lookup", "content": "42"},
    {"role": "assistant", "content": "<think>\nThe tool said 42.\n</think>\n\nIt is 42."},
    {"role": "user", "content": "Thanks. And key b?"},
    {"role": "assistant", "content": "I do not know."},
]


class HFTemplateFormat:
    """Any Hugging Face Jinja chat template, one message at a time, by render-and-diff.

    Each segment is the tokenized text that the new message adds to transformers'
    rendering of the conversation (`apply_chat_template(..., tokenize=False)`). The
    closing of an assistant turn is read off the probe: the text the template writes
    after an assistant message's content; its first token, when special, is the
    end-of-turn token.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None):
        template = chat_template if chat_template is not None else tokenizer.chat_template
        if not isinstance(template, str) or not template.strip():
            raise ValueError(
                "no chat template: the tokenizer has none and chat_template was not given"
            )
        self.tokenizer = tokenizer
        self.chat_template = template
        closing_text = self._probe()
        closing = self._encode(closing_text)
        specials = set(tokenizer.all_special_ids)
        eos = tokenizer.eos_token_id
        if closing and closing[0] in specials:
            self._end_of_turn_id: int | None = closing[0]
        else:
            self._end_of_turn_id = eos if isinstance(eos, int) else None
        self._closing = closing
        ids = [self._end_of_turn_id, eos]
        self._stop_ids = [t for i, t in enumerate(ids) if isinstance(t, int) and t not in ids[:i]]

    # -- rendering ---------------------------------------------------------------

    def render_text(
        self, messages: Sequence[Message], tools: Sequence[ToolLike] = (),
        add_generation_prompt: bool = False,
    ) -> str:
        """transformers' rendering of `messages` (what `apply_chat_template(...,
        tokenize=False)` returns, empty conversations included); "" for an empty
        conversation the template cannot render."""
        try:
            special_tokens: dict[str, Any] = dict(  # str values, **-splatted beside non-str params
                self.tokenizer.special_tokens_map)
            rendered, _ = render_jinja_template(  # type: ignore[str-unpack]  # (texts, indices)
                conversations=[[dict(m) for m in messages]],
                tools=hf_tools(tools),  # type: ignore[arg-type]
                chat_template=self.chat_template, add_generation_prompt=add_generation_prompt,
                **special_tokens,
            )
            text = rendered[0]
        except Exception as e:
            if not messages and not add_generation_prompt:
                return ""  # many templates index messages[0]; nothing rendered yet
            raise ValueError(f"chat template failed to render {len(messages)} messages "
                             f"(add_generation_prompt={add_generation_prompt}): {e}") from e
        if not isinstance(text, str):
            raise ValueError(f"chat template rendered {type(text).__name__}, expected str")
        return text

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _diff(self, earlier: str, later: str, what: str) -> str:
        if not later.startswith(earlier):
            raise TemplateNotAppendOnlyError(what, _first_difference(earlier, later),
                                             earlier, later)
        return later[len(earlier):]

    # -- the ChatFormat protocol ------------------------------------------------------

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self._stop_ids)

    @property
    def end_of_turn_token_id(self) -> int | None:
        return self._end_of_turn_id

    def render_fixed_prefix(self, system: str | None, tools: Sequence[ToolLike]) -> list[int]:
        history = [] if system is None else [{"role": "system", "content": check_text(
            "system", system)}]
        return self._encode(self.render_text(history, tools))

    def render_message(
        self, role: str, content: str, name: str | None = None, *,
        history: Sequence[Message] = (), tools: Sequence[ToolLike] = (),
    ) -> list[int]:
        check_role(role)
        message = {"role": role, "content": check_text("content", content)}
        if name:
            message["name"] = name
        earlier = self.render_text(history, tools)
        later = self.render_text([*history, message], tools)
        return self._encode(self._diff(earlier, later, f"adding a {role} message changes "
                                                       "the rendering of the messages before it"))

    def generation_header(
        self, *, history: Sequence[Message] = (), tools: Sequence[ToolLike] = ()
    ) -> list[int]:
        earlier = self.render_text(history, tools)
        later = self.render_text(history, tools, add_generation_prompt=True)
        return self._encode(self._diff(earlier, later, "the generation prompt does not "
                                                       "extend the rendered conversation"))

    def end_of_turn(self, after_token: int | None = None) -> list[int]:
        if after_token is not None and after_token == self._end_of_turn_id:
            return self._closing[1:] if self._closing[:1] == [after_token] else list(self._closing)
        return list(self._closing)

    def render_reply(
        self, text: str, *, history: Sequence[Message] = (), tools: Sequence[ToolLike] = ()
    ) -> list[int]:
        reply = self._encode(check_text("text", text))
        if self._end_of_turn_id is not None:
            reply.append(self._end_of_turn_id)
        return reply

    # -- the probe ------------------------------------------------------------------

    def _probe(self) -> str:
        """Render a small conversation turn by turn, as a Conversation would build it.

        Returns the closing text (what follows an assistant message's content); raises
        TemplateNotAppendOnlyError at the first rendering that is not an extension."""
        try:
            self.render_text([_PROBE_SYSTEM])
            start: list[dict[str, str]] = [dict(_PROBE_SYSTEM)]
        except ValueError:  # a template without a system role
            start = []
        try:
            return self._probe_turns(start, _PROBE_TURNS)
        except TemplateNotAppendOnlyError:
            raise
        except ValueError:  # a template without tool messages: probe plain dialogue
            plain = [m for m in _PROBE_TURNS[3:]]
            plain.insert(0, _PROBE_TURNS[0])
            return self._probe_turns(start, plain)

    def _probe_turns(self, start: list[dict[str, str]], turns: list[dict[str, str]]) -> str:
        history = list(start)
        closing: str | None = None
        rendered = self.render_text(history)
        for message in turns:
            if message["role"] == "assistant":
                prompt = self.render_text(history, add_generation_prompt=True)
                self._diff(rendered, prompt, "the generation prompt does not extend the "
                                             "rendered conversation")
                full = self.render_text([*history, message])
                expected = prompt + message["content"]
                self._diff(expected, full, "an assistant reply is not rendered as the generation prompt "
                           "followed by the reply text unchanged")
                if closing is None:
                    closing = full[len(expected):]
            else:
                full = self.render_text([*history, message])
                self._diff(rendered, full, f"adding a {message['role']} message changes the "
                                           "rendering of the earlier turns (e.g. past reasoning "
                                           "or tool calls are dropped or rewritten)")
            history.append(message)
            rendered = full
        return closing or ""


def _first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
