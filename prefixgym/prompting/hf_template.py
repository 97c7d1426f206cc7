"""The Hugging Face chat-template adapter: any Jinja chat template, one message at a time.

`HFTemplateFormat` implements the `ChatFormat` protocol (see `chat_format.py`) by
render-and-diff: it renders the conversation with and without the new message exactly
as transformers' `apply_chat_template(..., tokenize=False)` would (with the template's
switches, e.g. `enable_thinking`, from `template_kwargs`), and tokenizes the text
difference. The constructor runs the template probes (`templates.probe_template`:
replies with reasoning blocks, with whitespace around them, ending with and without
the end-of-turn token, tools passed and not) under those switches.

A template that is not append-only because of what it does to earlier replies -- the
reasoning-model templates (Qwen3, QwQ, DeepSeek-R1 distills) strip an earlier turn's
`<think>` block -- is still used token by token, the way a Conversation works anyway:
each new turn (the env's message, the generation prompt) is rendered against a history
whose replies are neutral text, so only that turn's own tokens are appended to what
was sampled, and no reply is ever rendered again. `template_mismatch` then holds the
probes' findings: what the template would have rendered differently (the model sees
every earlier reply as sampled here, a stripped one under `apply_chat_template`), for
the caller to say. A template that breaks even so (it marks the last message, or
renders a message by its position) raises `TemplateNotAppendOnlyError` with the rule
and reason; so does any break with `strict=True`.

`template_report` keeps the probes' verdict at the switches given (what `lint template
--template-kwargs` says for them), for a command's first lines. A template that reads
message content as lists of text parts (a vision-language model's) gets every
message's content written that way, as the probes found it reads it.

Every render, the probes' and each turn's, runs in the render worker under its limits
(`templates.RenderLimits`: time, memory, output), so a template that runs away on some
conversation fails that render with a ValueError instead of taking the process.

This module knows templates, text and tokens; it keeps no conversation state and
knows nothing of the built-in ChatML format, sampling, caches or envs.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from transformers import PreTrainedTokenizerBase

from prefixgym.prompting.findings import RULES, Finding
from prefixgym.prompting.messages import Message, check_role, check_text
from prefixgym.prompting.templates import TemplateRenderer, TemplateReport, probe_template
from prefixgym.prompting.templates.content import STRINGS, ContentShape, shaped
from prefixgym.prompting.templates.jinja_render import RenderError, RenderLimitError
from prefixgym.prompting.tools import ToolLike, as_tools, tool
from prefixgym.types import JSONObject

__all__ = ["HFTemplateFormat", "TemplateNotAppendOnlyError", "hf_tools"]

NEUTRAL_REPLY = "Done."
"""The text earlier replies are rendered with when a template rewrites them."""
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
    rendering of the conversation (`apply_chat_template(..., tokenize=False)`), with
    `template_kwargs` passed to every render. The closing of an assistant turn is read
    off the probe: the text the template writes after an assistant message's content;
    its first token, when special, is the end-of-turn token. See the module docstring
    for templates that rewrite earlier replies, and `strict`.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None,
                 *, template_kwargs: JSONObject | None = None, strict: bool = False):
        template = chat_template if chat_template is not None else tokenizer.chat_template
        if not isinstance(template, str) or not template.strip():
            raise ValueError(
                "no chat template: the tokenizer has none and chat_template was not given"
            )
        self.tokenizer = tokenizer
        self.chat_template = template
        self.template_kwargs: JSONObject = dict(template_kwargs or {})
        self.template_mismatch: list[Finding] = []
        """What the template renders otherwise than the token-level conversation (empty
        for an append-only template)."""
        self._neutral_history = False
        self._content: dict[str, ContentShape] = dict(STRINGS)
        self.template_report: TemplateReport | None = None
        """The probes' verdict at `template_kwargs`, set by the constructor."""
        specials: dict[str, Any] = dict(tokenizer.special_tokens_map)
        self._renderer = TemplateRenderer(  # raises LintInputError (a ValueError): syntax
            template, specials.get("bos_token"), specials.get("eos_token"),
            origin="chat template", variables={**specials, **self.template_kwargs})
        closing = self._encode(self._probe(strict))
        special_ids = set(tokenizer.all_special_ids)
        eos = tokenizer.eos_token_id
        if closing and closing[0] in special_ids:
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
            text = self._renderer.render(shaped([dict(m) for m in messages], self._content),
                                         add_generation_prompt, hf_tools(tools),
                                         clock=datetime.now())
        except RenderLimitError as e:
            raise ValueError(f"chat template: rendering exceeded a limit ({e}): the template "
                             f"loops or grows without bound on {len(messages)} messages") from None
        except RenderError as e:
            if not messages and not add_generation_prompt:
                return ""  # many templates index messages[0]; nothing rendered yet
            raise ValueError(f"chat template failed to render {len(messages)} messages "
                             f"(add_generation_prompt={add_generation_prompt}): {e}") from None
        return text

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _history(self, history: Sequence[Message]) -> Sequence[Message]:
        """The history a new turn is rendered against: as given, or, for a template that
        rewrites earlier replies, with every reply's text neutral (so that rewriting it
        changes nothing before the new turn)."""
        if not self._neutral_history:
            return history
        return [{**m, "content": NEUTRAL_REPLY} if m["role"] == "assistant" else m
                for m in history]

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
        history = self._history(history)
        earlier = self.render_text(history, tools)
        later = self.render_text([*history, message], tools)
        return self._encode(self._diff(earlier, later, f"adding a {role} message changes "
                                                       "the rendering of the messages before it"))

    def generation_header(
        self, *, history: Sequence[Message] = (), tools: Sequence[ToolLike] = ()
    ) -> list[int]:
        history = self._history(history)
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

    def _probe(self, strict: bool) -> str:
        """Run the template probes (`templates.probe_template`), rendering as this adapter
        does, and return the closing text (what follows a reply's content).

        A break under the given switches: with `strict`, TemplateNotAppendOnlyError with
        the rule and reason; otherwise the neutral-history rendering is tried on a
        conversation with a reasoning reply, and kept (the findings in
        `template_mismatch`) when every turn then extends the last. ValueError when the
        template renders none of the probes or runs away."""
        renderer = self._renderer  # the probes render as every turn does
        specials = {k: v for k, v in renderer.variables.items() if k not in self.template_kwargs}
        report = probe_template(self.chat_template, renderer.bos_token, renderer.eos_token,
                                origin="chat template", variables=specials,
                                template_kwargs=self.template_kwargs)
        self.template_report = report
        self._content = report.content
        runaway = next((f.message for f in report.findings if f.rule == "PG113"), None)
        if runaway is not None:
            raise ValueError(f"chat template: {runaway}")
        if report.num_checked_by_default == 0:
            failed = next((f.message for f in report.findings if f.rule in ("PG106", "PG109")), "")
            raise ValueError(f"chat template failed to render the probe conversations: {failed}")
        breaks = [f for f in report.findings if f.rule in report.breaks_by_default
                  and f.rule not in CONVERSATION_UNAFFECTED]
        if breaks and not strict:
            self._neutral_history = True
            try:
                self._check_turn_by_turn()
            except TemplateNotAppendOnlyError:
                self._neutral_history = False
            else:
                self.template_mismatch = breaks
                return report.closing if report.closing is not None else self._read_closing()
        if breaks:
            raise TemplateNotAppendOnlyError.from_finding(breaks[0])
        return report.closing or ""

    def _read_closing(self) -> str:
        """What follows a reply's text in the template's rendering of it (the probes could
        not tell, e.g. a generation prompt's empty think block the history drops)."""
        base: list[Message] = [{"role": "user", "content": "Hi."}]
        before = self.render_text(base)
        after = self.render_text([*base, {"role": "assistant", "content": NEUTRAL_REPLY}])
        rest = after[len(before):] if after.startswith(before) else ""
        at = rest.find(NEUTRAL_REPLY)
        return rest[at + len(NEUTRAL_REPLY):] if at >= 0 else ""

    def _check_turn_by_turn(self) -> None:
        """Render conversations whose replies reason, with tools and without, turn by turn
        as a Conversation does; TemplateNotAppendOnlyError if a turn does not extend the
        last."""
        for tools in ((), (_probe_tool,)):
            history: list[Message] = [{"role": "system", "content": "Answer briefly."}]
            for question, reply in (("What is 2 + 2?", "<think>\nAdd.\n</think>\n\n4."),
                                    ("And 3 + 3?", "<think>\nAgain.\n</think>\n\n6.")):
                self.render_message("user", question, history=history, tools=tools)
                history.append({"role": "user", "content": question})
                self.generation_header(history=history, tools=tools)
                history.append({"role": "assistant", "content": reply})
            self.render_message("user", "Thanks.", history=history, tools=tools)


@tool
def _probe_tool(key: str) -> str:
    """Look a key up (a tool the turn-by-turn check renders templates with).

    Args:
        key: The key.
    """
    return key


def _first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
