"""The Hugging Face chat-template adapter: any Jinja chat template, one message at a time.

`HFTemplateFormat` implements the `ChatFormat` protocol (see `chat_format.py`) by
render-and-diff: it renders the conversation with and without the new message exactly
as transformers' `apply_chat_template(..., tokenize=False)` would, and tokenizes the
text difference. That only works for templates whose rendering of a conversation
extends the rendering of its beginning, and that render a reply as it was sampled.
The constructor runs the linter's probes (`lint.template.probe_template`: replies
with reasoning blocks, with whitespace around them, ending with and without the
end-of-turn token, tools passed and not) under the template's defaults, and raises
`TemplateNotAppendOnlyError` with the linter's rule and reason for one that breaks.

This module knows templates, text and tokens; it keeps no conversation state and
knows nothing of the built-in ChatML format, sampling, caches or envs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from prefixgym.prompting.findings import RULES, Finding
from prefixgym.prompting.messages import Message, check_role, check_text
from prefixgym.prompting.templates import probe_template
from prefixgym.prompting.tools import ToolLike, as_tools
from prefixgym.types import JSONObject

__all__ = ["HFTemplateFormat", "TemplateNotAppendOnlyError", "hf_tools"]

CONVERSATION_UNAFFECTED = frozenset({"PG112"})
"""Breaks that matter to code re-rendering history with the template, not to a
`Conversation`: it keeps each reply's sampled ids verbatim and renders new messages by
diffing two renderings that trim the reply alike (PG112: the template trims or pads
the reply's whitespace). Llama-3's and Gemma's `content | trim` templates are usable."""


class TemplateNotAppendOnlyError(ValueError):
    """A chat template renders a longer conversation as something other than an extension.

    `earlier` and `later` are the two renderings, or windows of them that begin at
    character `start`; `index` is where they part, counted from the renderings' start.
    `rule` is the linter's rule code (PG101...) when the linter's probes found it."""

    def __init__(self, reason: str, index: int, earlier: str, later: str, *,
                 rule: str | None = None, start: int = 0) -> None:
        self.reason = reason
        self.index = index
        self.rule = rule
        lo = max(0, index - start - 40)
        self.earlier_text = earlier[lo : index - start + 40]
        self.later_text = later[lo : index - start + 40]
        code = f" ({rule} {RULES[rule].name})" if rule in RULES else ""
        super().__init__(
            f"chat template is not append-only{code}: {reason}. First difference at character "
            f"{index}: the earlier rendering reads {self.earlier_text!r}, the later one reads "
            f"{self.later_text!r}. Building prompts by appending tokens would not match what "
            "the template renders; pass an append-only template (e.g. one that keeps past "
            "reasoning) or use the built-in format"
        )

    @classmethod
    def from_finding(cls, finding: Finding) -> TemplateNotAppendOnlyError:
        """The error for a linter finding: its reason, where it was seen and the text."""
        index = finding.first_divergence or 0
        caret = finding.caret or 0
        return cls(f"{finding.message} (seen in {finding.location})", index,
                   finding.expected or "", finding.actual or "", rule=finding.rule,
                   start=index - caret)


def hf_tools(tools: Sequence[ToolLike]) -> list[JSONObject] | None:
    """Tools as Hugging Face chat templates expect them ({"type": "function", ...}); a
    function or a pydantic model class is converted as `@tool` / `Tool.from_model` do."""
    return [{"type": "function", "function": t.schema()} for t in as_tools(tools)] or None


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
        closing = self._encode(self._probe())
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
        """Run the linter's probes (`lint.template.probe_template`), rendering as this
        adapter does, and return the closing text (what follows a reply's content).

        Raises TemplateNotAppendOnlyError, with the linter's rule and reason, for the
        first rule that breaks under the template's defaults (the adapter passes no
        switch); ValueError when the template renders none of the probes."""
        specials: dict[str, Any] = dict(self.tokenizer.special_tokens_map)
        report = probe_template(self.chat_template, specials.get("bos_token"),
                                specials.get("eos_token"), origin="chat template",
                                variables=specials)
        runaway = next((f.message for f in report.findings if f.rule == "PG113"), None)
        if runaway is not None:
            raise ValueError(f"chat template: {runaway}")
        if report.num_checked_by_default == 0:
            failed = next((f.message for f in report.findings if f.rule in ("PG106", "PG109")), "")
            raise ValueError(f"chat template failed to render the probe conversations: {failed}")
        finding = next((f for f in report.findings if f.rule in report.breaks_by_default
                        and f.rule not in CONVERSATION_UNAFFECTED), None)
        if finding is not None:
            raise TemplateNotAppendOnlyError.from_finding(finding)
        return report.closing or ""


def _first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
