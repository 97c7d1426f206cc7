"""Write an append-only variant of a chat template: history rendered as it was sampled.

A template that is not append-only rewrites, once a turn is history, what it rendered
before (Qwen3 and the DeepSeek-R1 distills drop earlier reasoning; others move the
whitespace around a reply). The variant keeps the template whole and wraps it: the
original becomes a macro, and a short driver after it renders the conversation one
message at a time, as a `Conversation` builds it:
- a user, system or tool message, or an assistant message with tool calls: the text
  the original adds for it after the history so far, whose replies are a stand-in;
- an assistant reply: the original's generation prompt there, then the reply's text as
  it was sampled (reasoning and all), framed by the separator and the closing the
  probes read off the template (`TemplateReport.separator`, `.closing`);
- the generation prompt: the original's, after that same history.
So every piece of text is the original's own but each reply, which is as sampled: the
latest turn renders as the original renders it, and the whitespace around a reply is
where the generation prompt put it. Each render of the variant renders the original
twice per message (a conversation of n messages costs O(n^2) message renders).

`fix_template` writes the variant, checks that the template renders inside the macro as
it does alone and that the latest turn renders as the original's, and lints it again
at the same settings. It refuses, with the reason, where the variant still breaks: the
original rewrites other messages than replies (a system prompt moved into the latest
user message, tools listed there, an EOS closing every rendering), which no rendering
of replies can change. Knows templates as text; renders through `TemplateRenderer`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefixgym.prompting.templates.append_only import TemplateReport, probe_template
from prefixgym.prompting.templates.content import shaped
from prefixgym.prompting.templates.probes import ANSWERS, QUESTIONS, REASONING, SYSTEM_TEXT
from prefixgym.prompting.templates.render import RenderError, TemplateRenderer
from prefixgym.types import JSONObject

STAND_IN = "Done."
"""The text earlier replies have when the original renders the history before a message."""
SENTINEL = "(prefixgym --fix: a later question)"
"""A user message put after the history, so that the original renders it as it does once
more follows."""
MACRO = "prefixgym_original"


@dataclass
class TemplateFix:
    """A variant and its lint, or the reason there is none."""

    variant: str | None
    report: TemplateReport | None
    """The variant's verdict, at the settings the original was linted at."""
    refused: str = ""
    diff: str = ""


def _literal(text: str) -> str:
    """`text` as a Jinja string literal."""
    escaped = (text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
               .replace("\r", "\\r").replace("\t", "\\t"))
    return f"'{escaped}'"


def _wrapped(template: str) -> str:
    # No whitespace control around the macro's tags, so the original's first and last
    # characters stay its own: trim_blocks drops the newline right after the opening tag,
    # and the closing tag follows the original's last character.
    return f"{{% macro {MACRO}(messages, add_generation_prompt) %}}\n{template}{{% endmacro %}}"


def variant_text(template: str, separator: str, closing: str, parts: bool = False) -> str:
    """The original wrapped as a macro, and the driver that renders replies as sampled.
    `parts`: the template reads an assistant's content as a list of text parts."""
    stand_in = (f"[{{'type': 'text', 'text': {_literal(STAND_IN)}}}]" if parts
                else _literal(STAND_IN))
    driver = f"""
{{#- prefixgym lint template --fix: the template above, whole, as a macro; below, each reply
    rendered as it was sampled (after the original's generation prompt, closed by the
    original's end of turn), every other message and the generation prompt as the
    original renders them after a history whose replies are a stand-in. A message the
    original renders only by rewriting the history before it is taken as the original
    renders it alone, when that is how the longer rendering ends. -#}}
{{%- macro pgfix_fail(what) -%}}
{{{{- raise_exception('--fix: ' ~ what ~ ', so the template cannot be rendered one message at a '
    ~ 'time') -}}}}
{{%- endmacro -%}}
{{%- set pgfix = namespace(history=[], text='', before='', own='') -%}}
{{%- for pgfix_m in messages -%}}
{{%- set pgfix.before = {MACRO}(pgfix.history, false) if pgfix.history else '' -%}}
{{%- if pgfix_m.role == 'assistant' and not pgfix_m.tool_calls -%}}
{{%- set pgfix_prompt = {MACRO}(pgfix.history, true) -%}}
{{%- if not pgfix_prompt.startswith(pgfix.before) -%}}
{{{{- pgfix_fail('the generation prompt does not extend the rendering of the messages before it') -}}}}
{{%- endif -%}}
{{%- set pgfix_reply = pgfix_m.content if pgfix_m.content is string else
    (pgfix_m.content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('')) -%}}
{{%- set pgfix.text = pgfix.text + pgfix_prompt[pgfix.before | length:] + {_literal(separator)}
    + pgfix_reply + {_literal(closing)} -%}}
{{%- set pgfix.history = pgfix.history + [{{'role': 'assistant', 'content': {stand_in}}}] -%}}
{{%- else -%}}
{{%- set pgfix_after = {MACRO}(pgfix.history + [pgfix_m], false) -%}}
{{%- if pgfix_after.startswith(pgfix.before) -%}}
{{%- set pgfix.own = pgfix_after[pgfix.before | length:] -%}}
{{%- else -%}}
{{#- the original renders the last message otherwise (Qwen3: an empty think block on the
    latest reply): with a user message after both, this message's text is what the longer
    rendering inserts, and it ends the rendering of this message alone -#}}
{{%- set pgfix_then = [{{'role': 'user', 'content': {_literal(SENTINEL)}}}] -%}}
{{%- set pgfix_without = {MACRO}(pgfix.history + pgfix_then, false) -%}}
{{%- set pgfix_with = {MACRO}(pgfix.history + [pgfix_m] + pgfix_then, false) -%}}
{{%- set pgfix_alone = {MACRO}([pgfix_m], false) -%}}
{{%- set pgfix_size = (pgfix_with | length) - (pgfix_without | length) -%}}
{{%- set pgfix.own = pgfix_alone[(pgfix_alone | length) - pgfix_size:]
    if 0 < pgfix_size <= (pgfix_alone | length) else '' -%}}
{{%- set pgfix_at = pgfix_with.rfind(pgfix.own) -%}}
{{%- if not pgfix.own or pgfix_at < 0
    or pgfix_without[:pgfix_at] + pgfix.own + pgfix_without[pgfix_at:] != pgfix_with -%}}
{{{{- pgfix_fail('adding a ' ~ pgfix_m.role ~ ' message changes the rendering of the messages '
    ~ 'before it') -}}}}
{{%- endif -%}}
{{%- endif -%}}
{{%- if pgfix_m.role == 'assistant' -%}}
{{#- a tool call: after the generation prompt instead of the history's own header for the
    turn (read off a stand-in reply), where they differ -#}}
{{%- set pgfix_plain = {MACRO}(pgfix.history + [{{'role': 'assistant', 'content': {stand_in}}}],
    false)[pgfix.before | length:] -%}}
{{%- set pgfix_head = pgfix_plain[:pgfix_plain.rfind({_literal(STAND_IN)})] -%}}
{{%- set pgfix_prompt = {MACRO}(pgfix.history, true) -%}}
{{%- if pgfix.own.startswith(pgfix_head) and pgfix_prompt.startswith(pgfix.before) -%}}
{{%- set pgfix.own = pgfix_prompt[pgfix.before | length:] + {_literal(separator)}
    + pgfix.own[pgfix_head | length:] -%}}
{{%- endif -%}}
{{%- set pgfix_m = {{'role': 'assistant', 'content': {stand_in}, 'tool_calls': pgfix_m.tool_calls}} -%}}
{{%- endif -%}}
{{%- set pgfix.text = pgfix.text + pgfix.own -%}}
{{%- set pgfix.history = pgfix.history + [pgfix_m] -%}}
{{%- endif -%}}
{{%- endfor -%}}
{{{{- pgfix.text -}}}}
{{%- if add_generation_prompt -%}}
{{%- set pgfix.before = {MACRO}(pgfix.history, false) if pgfix.history else '' -%}}
{{%- set pgfix_prompt = {MACRO}(pgfix.history, true) -%}}
{{%- if not pgfix_prompt.startswith(pgfix.before) -%}}
{{{{- pgfix_fail('the generation prompt does not extend the rendering of the messages before it') -}}}}
{{%- endif -%}}
{{{{- pgfix_prompt[pgfix.before | length:] -}}}}
{{%- endif -%}}
"""
    return _wrapped(template) + driver


def _conversations() -> list[list[JSONObject]]:
    """Conversations ending in a user message: one question, with and without a system
    message, and two, the reply between them plain or reasoning."""
    reasoning = f"<think>\n{REASONING[0]}\n</think>\n\n{ANSWERS[0]}"
    system: list[JSONObject] = [{"role": "system", "content": SYSTEM_TEXT}]
    first: list[JSONObject] = [{"role": "user", "content": QUESTIONS[0]}]
    return [first, system + first] + [
        head + first + [{"role": "assistant", "content": reply},
                        {"role": "user", "content": QUESTIONS[1]}]
        for head in ([], system) for reply in (ANSWERS[0], reasoning)]


def _read_frame(renderer: TemplateRenderer, content: Mapping[str, Any]) -> tuple[str, str] | None:
    """(separator, closing) around a stand-in reply after one user message, where the
    probes could not read them (the history moves the generation prompt's whitespace)."""
    user: list[JSONObject] = [{"role": "user", "content": QUESTIONS[0]}]
    try:
        before = renderer.render(shaped(user, content), False)
        prompt = renderer.render(shaped(user, content), True)
        after = renderer.render(shaped(user + [{"role": "assistant", "content": STAND_IN}],
                                       content), False)
    except RenderError:
        return None
    at = after.rfind(STAND_IN)
    if not after.startswith(before) or at < 0:
        return None
    head, gen = after[len(before):at], prompt[len(before):]
    separator = head[len(gen):] if head.startswith(gen) and head[len(gen):].isspace() else ""
    return separator, after[at + len(STAND_IN):]


def _stand_ins(messages: list[JSONObject]) -> list[JSONObject]:
    return [{**m, "content": STAND_IN} if m["role"] == "assistant" else m for m in messages]


def _check(original: TemplateRenderer, variant: TemplateRenderer, wrapped: TemplateRenderer,
           content: Mapping[str, Any], closing: str) -> str:
    """'' when the original renders alike inside the macro and the variant renders the
    latest turn (the last message and the generation prompt) as the original does; else
    what differs. Without a reply the two render alike; after one, the original's text
    from the end of its stand-in reply ends with the variant's from the reply's closing."""
    def render(renderer: TemplateRenderer, messages: list[JSONObject], generation: bool) -> str:
        return renderer.render(shaped(messages, content), generation)

    for messages in _conversations():
        for generation in (False, True):
            if render(wrapped, messages, generation) != render(original, messages, generation):
                return "the template renders otherwise inside a macro"
        replies = [m for m in messages if m["role"] == "assistant"]
        ours = render(variant, messages, True)
        if not replies:
            same = ours == render(original, messages, True)
        else:
            theirs = render(original, _stand_ins(messages), True)
            reply = str(replies[-1]["content"]) + closing
            same = theirs[theirs.rfind(STAND_IN) + len(STAND_IN):].endswith(
                ours[ours.rfind(reply) + len(reply):])
        if not same:
            return ("the variant would render the latest turn otherwise than the template "
                    "(the template rewrites the latest message with what came before it)")
    return ""


def _driver_words(error: str) -> str:
    """The reason the variant's driver raised with, without what wraps it; else `error`."""
    own = re.search(r"--fix: (.*?one message at a time)", error)
    return own.group(1) if own else f"a render failed: {error}"


def fix_template(template: str, report: TemplateReport, bos_token: str | None,
                 eos_token: str | None, variables: Mapping[str, Any] | None = None,
                 origin: str = "<fixed>", strict: bool = False) -> TemplateFix:
    """An append-only variant of `template`, linted at `report.settings`, or the reason
    there is none. `report` is the original's lint at those settings."""
    if report.append_only:
        return TemplateFix(None, report, "the template is append-only at these settings already")
    kwargs = {**(variables or {}), **report.settings}
    parts = report.content.get("assistant") == "parts"
    frame = ((report.separator, report.closing) if report.closing is not None else
             _read_frame(TemplateRenderer(template, bos_token, eos_token, origin, kwargs),
                         report.content))
    if frame is None:
        return TemplateFix(None, None, "the template's end of turn (what it writes after a "
                           "reply) could not be read, and every reply needs one")
    separator, closing = frame
    if closing.strip() and closing[:1].isspace():
        # a reply ends on its end-of-turn token: as sampled, no whitespace comes before it
        closing = closing.lstrip()
    variant = variant_text(template, separator, closing, parts)
    original, ours, wrapped = (
        TemplateRenderer(t, bos_token, eos_token, origin, kwargs)
        for t in (template, variant,
                  _wrapped(template) + f"{{{{ {MACRO}(messages, add_generation_prompt) }}}}"))
    try:
        problem = _check(original, ours, wrapped, report.content, closing)
    except RenderError as e:
        problem = _driver_words(str(e))
    if problem:
        return TemplateFix(None, None, problem)
    fixed = probe_template(variant, bos_token, eos_token, origin=origin, variables=variables,
                           strict=strict, template_kwargs=report.settings)
    lost = [name for name in report.probes_checked if name not in fixed.probes_checked]
    if lost:  # the driver raised where the original rendered: it rewrites other messages
        why = next((f.message for f in fixed.findings if f.rule in ("PG106", "PG109")),
                   fixed.probes_skipped.get(lost[0], ""))
        why = _driver_words(why)
        return TemplateFix(None, fixed, f"the variant fails probe '{lost[0]}', which the "
                           f"template renders: {why}")
    if not fixed.append_only:
        first = next((f for f in fixed.findings if f.severity == "error"), None) or next(
            iter(fixed.findings), None)
        why = f"{first.rule} {first.message}" if first else "no probe could be checked"
        return TemplateFix(None, fixed, "rendering each reply as sampled does not make it "
                           f"append-only: the template rewrites other messages too ({why})")
    diff = "".join(difflib.unified_diff(template.splitlines(keepends=True),
                                        variant.splitlines(keepends=True),
                                        report.target, origin))
    return TemplateFix(variant, fixed, diff=diff)
