"""Is `prefixgym lint template` right on chat templates it was not written against?

For every `.jinja` file in `--templates DIR` this script establishes the truth by
rendering, with its own code and transformers' renderer (nothing of the linter's
probes, checks or classifier), then asks the linter (`probe_template`, what `prefixgym
lint template` calls) for its verdict at the template's defaults, and prints one row
per template: template, truth, verdict, the content shape each used, agree?

The truth rule (append-only at the template's defaults). For conversations of a user
turn, then 3 x (assistant reply, user turn), the generation prompts P_1..P_4 are
rendered. A model that sampled after P_k wrote: optional whitespace, then the reply's
content as the message holds it, then a stop sequence ending on its stop token (a
family-specific framing head may come first, e.g. gpt-oss's final channel header).
The template is append-only when, for every such conversation and every k, P_{k+1}
starts with P_k + that sampled text. Why these are "the same tokens": the sampler
appends the ids it sampled and never re-tokenizes them, so only text the model wrote
can be taken as sampled; whitespace before the content is allowed because it belongs
to the first sampled token (SentencePiece's '▁', or a newline the model learned from
the template's own history); text the template puts between the content and the stop
token (a space, a newline) was never sampled, so it breaks the prefix; text after the
stop token is the template's next segment and may be anything.

The conversations vary: with and without a system message; with and without a tool
definition passed; plain replies, and, where the template's source names '</think>',
replies with a reasoning block (after a prompt that opened '<think>' the content is the
continuation the model writes, and a plain reply does not apply); a tool call, its
result, then an answer (the call's own text is the template's to write, so only the
prompt after the result extending the first prompt, and the answer, are checked);
message content as plain strings, and as lists of `{"type": "text"}` parts where the
template shows the text of parts (roles whose parts it does not show keep strings). A
conversation the template raises on is skipped and counted; a template that raises on
every one is "unrenderable".

A second rule ("diffs" column) asks what prefixgym's own chat format needs besides: it
renders each new message as the difference of two renders without a generation prompt,
so each generation prompt must extend the history before it, and each user message the
history with the reply. A template that appends EOS to a history without a generation
prompt (TRL's Phi-3 templates) passes the first rule and fails this one.

`DIR/manifest.json` (optional) gives, per file name: "bos", "eos" (handed to both the
renders and the linter), "stops" (the sampled stop sequences; default: [eos]) and
"heads" (sampled framing before the content; default: none).

    .venv/bin/python bench/check_lint_templates.py --templates /tmp/templates [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers.utils.chat_template_utils import render_jinja_template

from prefixgym.prompting.findings import LintInputError
from prefixgym.prompting.templates.append_only import probe_template
from prefixgym.prompting.templates.content import describe

SYSTEM = "You answer arithmetic questions briefly."
USERS = ("What is 1 + 1?", "And 2 + 2?", "And 3 + 3?", "Thank you.")
ANSWERS = ("1 + 1 = 2.", "2 + 2 = 4.", "3 + 3 = 6.")
THOUGHTS = ("One and one make two.", "Two and two make four.", "Three and three make six.")
TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "integer", "description": "first"},
        "b": {"type": "integer", "description": "second"}}}}}
CALL: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [{
    "id": "call000001", "type": "function",
    "function": {"name": "add", "arguments": {"a": 1, "b": 1}}}]}
CALL_JSON_ARGUMENTS = {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "function": {
    "name": "add", "arguments": json.dumps({"a": 1, "b": 1})}}]}
RESULT = {"role": "tool", "tool_call_id": "call000001", "name": "add", "content": "2"}
SHAPE_TEXT = "Shape check: the {role} writes this."
NOT_APPLICABLE = "not applicable"


@dataclass
class Truth:
    verdict: str  # "yes", "no" or "unrenderable"
    shape: str
    why: str = ""
    checked: int = 0
    skipped: list[str] = field(default_factory=list)
    diffs: str = "yes"  # the second rule: can each message be rendered as a diff
    diffs_why: str = ""


class Renderer:
    def __init__(self, template: str, entry: dict[str, Any]) -> None:
        self.template = template
        self.specials = {"bos_token": entry.get("bos", ""), "eos_token": entry.get("eos", "")}

    def __call__(self, messages: list[dict[str, Any]], generation: bool,
                 tools: list[dict[str, Any]] | None = None) -> str:
        render: Any = render_jinja_template  # annotated `-> str`; returns (texts, indices)
        rendered, _ = render(conversations=[messages], tools=tools, chat_template=self.template,
                             add_generation_prompt=generation, **self.specials)
        return str(rendered[0])


def parts(text: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": text}]


def shows(render: Renderer, role: str, as_parts: bool) -> bool:
    """Whether a message of `role` with content in this shape shows its text (not the
    list's repr)."""
    text = SHAPE_TEXT.format(role=role)
    content: Any = parts(text) if as_parts else text
    messages = {"system": [{"role": "system", "content": content}, {"role": "user", "content": "Hi."}],
                "user": [{"role": "user", "content": content}],
                "assistant": [{"role": "user", "content": "Hi."},
                              {"role": "assistant", "content": content},
                              {"role": "user", "content": "Go on."}]}[role]
    try:
        rendered = render(messages, role != "assistant")
    except Exception:  # noqa: BLE001  (a template may raise anything on a shape it rejects)
        return False
    # a list printed as Python's repr shows the text too, but not as the template means it
    return text in rendered and not any(r in rendered for r in ("'type': 'text'", '"type": "text"'))


def shape_modes(render: Renderer) -> list[dict[str, bool]]:
    """The content shapes to render in: {role: as_parts}. Strings when user strings
    show; parts (for the roles whose parts show) when user parts show."""
    roles = ("system", "user", "assistant")
    modes = []
    if shows(render, "user", False):
        modes.append(dict.fromkeys(roles, False))
    if shows(render, "user", True):
        modes.append({role: shows(render, role, True) for role in roles})
    return modes or [dict.fromkeys(roles, False)]


def name_mode(mode: dict[str, bool]) -> str:
    return describe({role: "parts" if p else "strings" for role, p in mode.items()})


def opened(prompt: str) -> bool:
    return prompt.rstrip().endswith("<think>")


def reply_content(prompt: str, k: int, reasoning: bool) -> str | None:
    """The reply's content as the model writes it after `prompt`; None for a plain reply
    after a prompt that opened a reasoning block (the model reasons there)."""
    if opened(prompt):  # the model continues the block the prompt opened
        if not reasoning:
            return None
        lead = "" if prompt[-1:].isspace() else "\n"
        return f"{lead}{THOUGHTS[k]}\n</think>\n\n{ANSWERS[k]}"
    if not reasoning or prompt.rstrip().endswith("</think>"):  # an empty block closed for it
        return ANSWERS[k]
    return f"<think>\n{THOUGHTS[k]}\n</think>\n\n{ANSWERS[k]}"


def extends(before: str, after: str, content: str, entry: dict[str, Any]) -> str | None:
    """None when `after` starts with `before` + what the model sampled, else why not."""
    if not after.startswith(before):
        at = next(i for i, (a, b) in enumerate(zip(before, after + "\0")) if a != b)
        return f"the next prompt rewrites the last one at char {at}: {before[at:at + 30]!r} -> {after[at:at + 30]!r}"
    rest = after[len(before):]
    stops = entry.get("stops") or [entry.get("eos", "")]
    for head in ["", *entry.get("heads", [])]:
        if not rest.startswith(head):
            continue
        body = rest[len(head):]
        body = body[len(body) - len(body.lstrip()):]
        if not body.startswith(content.lstrip()):
            continue
        tail = body[len(content.lstrip()):]
        if any(stop and tail.startswith(stop) for stop in stops):
            return None
        return f"after the reply comes {tail[:30]!r}, not a stop sequence {stops}"
    return f"the reply as sampled is not what follows the prompt: {rest[:50]!r}"


def conversation_break(render: Renderer, mode: dict[str, bool], system: bool,
                       tools: list[dict[str, Any]] | None, reply: str,
                       entry: dict[str, Any]) -> str | None:
    """Why this conversation's prompts do not extend each other; None when they do;
    NOT_APPLICABLE when its replies do not fit the template's prompts."""
    def shaped(role: str, text: str) -> dict[str, Any]:
        return {"role": role, "content": parts(text) if mode.get(role) else text}

    messages = ([shaped("system", SYSTEM)] if system else []) + [shaped("user", USERS[0])]
    prompt = render(messages, True, tools)
    if reply == "tool-call":
        # the call's own text is the template's to write: only check that the prompt
        # after the result extends the first, then that the answer extends as sampled
        # after a prompt that opened a reasoning block, the call's content is the rest of it
        lead = "" if prompt[-1:].isspace() else "\n"
        call_content = f"{lead}{THOUGHTS[0]}\n</think>\n\n" if opened(prompt) else ""
        try:
            call = {**CALL, "content": call_content}
            after_result = render(messages + [call, RESULT], True, tools)
        except Exception:  # noqa: BLE001  (some templates take the arguments as a JSON string)
            call = {**CALL_JSON_ARGUMENTS, "content": call_content}
            after_result = render(messages + [call, RESULT], True, tools)
        messages = messages + [call, RESULT]
        if not after_result.startswith(prompt):
            return "the prompt after the tool result rewrites the first prompt"
        answer = reply_content(after_result, 0, opened(after_result))
        if answer is None:
            return NOT_APPLICABLE
        messages = messages + [shaped("assistant", answer), shaped("user", USERS[3])]
        why = extends(after_result, render(messages, True, tools), answer, entry)
        return None if why is None else f"the answer after the tool result: {why}"
    for k in range(3):
        content = reply_content(prompt, k, reply == "reasoning")
        if content is None:
            return NOT_APPLICABLE
        messages = messages + [shaped("assistant", content), shaped("user", USERS[k + 1])]
        next_prompt = render(messages, True, tools)
        why = extends(prompt, next_prompt, content, entry)
        if why is not None:
            return f"turn {k + 1} -> {k + 2}: {why}"
        prompt = next_prompt
    return None


def diff_break(render: Renderer, mode: dict[str, bool], system: bool,
               tools: list[dict[str, Any]] | None) -> str | None:
    """The second rule: why the renders without a generation prompt cannot be diffed
    turn by turn (a generation prompt that does not extend the history before it, or a
    user message that does not extend the history with the reply), as prefixgym's chat
    format renders each new message; None when they can."""
    def shaped(role: str, text: str) -> dict[str, Any]:
        return {"role": role, "content": parts(text) if mode.get(role) else text}

    messages = ([shaped("system", SYSTEM)] if system else []) + [shaped("user", USERS[0])]
    for k in range(3):
        history, prompt = render(messages, False, tools), render(messages, True, tools)
        if not prompt.startswith(history):
            return f"turn {k + 1}: the generation prompt does not extend the history"
        content = reply_content(prompt, k, opened(prompt))
        messages = messages + [shaped("assistant", str(content))]
        with_reply = render(messages, False, tools)
        messages = messages + [shaped("user", USERS[k + 1])]
        if not render(messages, False, tools).startswith(with_reply):
            return f"turn {k + 1}: the next user message does not extend the history with the reply"
    return None


def truth(template: str, entry: dict[str, Any]) -> Truth:
    render = Renderer(template, entry)
    modes = shape_modes(render)
    result = Truth("yes", " | ".join(name_mode(m) for m in modes))
    for mode in modes:
        for system in (False, True):
            for tools, reply in [(None, "plain"), ([TOOL], "plain"), ([TOOL], "tool-call"),
                                 *([(None, "reasoning"), ([TOOL], "reasoning")]
                                   if "</think>" in template else [])]:
                label = (f"{name_mode(mode)}, system={system}, tools={tools is not None}, "
                         f"reply={reply}")
                try:
                    why = conversation_break(render, mode, system, tools, reply, entry)
                except Exception as exc:  # noqa: BLE001  (a template may raise anything)
                    result.skipped.append(f"{label}: {type(exc).__name__}: {exc}"[:160])
                    continue
                if why == NOT_APPLICABLE:
                    continue
                result.checked += 1
                if why is not None and result.verdict == "yes":
                    result.verdict, result.why = "no", f"{label}: {why}"
                if reply == "plain" and result.diffs == "yes":
                    why = diff_break(render, mode, system, tools)
                    if why is not None:
                        result.diffs, result.diffs_why = "no", f"{label}: {why}"
    if result.checked == 0:
        result.verdict = result.diffs = "unrenderable"
        result.why = result.skipped[0] if result.skipped else "no conversation rendered"
    return result


def verdict(template: str, entry: dict[str, Any], origin: str) -> tuple[str, str, str]:
    """(verdict, content shape, rules) from the linter at the template's defaults."""
    try:
        report = probe_template(template, entry.get("bos"), entry.get("eos"), origin=origin)
    except LintInputError as exc:
        return "error", "-", str(exc)
    rules = ",".join(f"{f.rule}{'(w)' if f.severity == 'warning' else ''}" for f in report.findings)
    return ("yes" if report.append_only else "no"), describe(report.content), rules


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--templates", type=Path, required=True, help="a directory of .jinja files")
    parser.add_argument("--json", type=Path, help="write every row, with the reasons, here")
    parser.add_argument("--only", default="", help="check only files whose name contains this")
    args = parser.parse_args()
    if not args.templates.is_dir():
        sys.exit(f"{args.templates}: not a directory")
    manifest_path = args.templates / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    except (OSError, json.JSONDecodeError) as exc:
        sys.exit(f"{manifest_path}: cannot read: {exc}")
    files = sorted(p for p in args.templates.glob("*.jinja") if args.only in p.name)
    if not files:
        sys.exit(f"{args.templates}: no .jinja files")
    rows = []
    print(f"{'template':44} {'truth':12} {'diffs':5} {'lint':5} {'agree':5}  "
          "content shape (truth / lint)  lint findings")
    for path in files:
        entry = manifest.get(path.name, {})
        template = path.read_text(encoding="utf-8")
        t = truth(template, entry)
        v, lint_shape, rules = verdict(template, entry, path.name)
        both = t.diffs if t.verdict == "yes" else t.verdict
        rows.append({"template": path.name, "truth": t.verdict, "diffs": t.diffs, "lint": v,
                     "agree": t.verdict == v, "agree_with_diffs": both == v,
                     "truth_shape": t.shape, "lint_shape": lint_shape, "findings": rules,
                     "why": t.why, "diffs_why": t.diffs_why, "checked": t.checked,
                     "skipped": t.skipped})
        print(f"{path.name[:44]:44} {t.verdict:12} {t.diffs:5} {v:5} "
              f"{'yes' if t.verdict == v else 'NO':5}  {t.shape} / {lint_shape}  {rules}",
              flush=True)
    print(f"\nagreement: {sum(r['agree'] for r in rows)} of {len(rows)} templates (truth: prompts)")
    print(f"agreement: {sum(r['agree_with_diffs'] for r in rows)} of {len(rows)} templates "
          "(truth: prompts, and each message renders as a diff of the history)")
    for r in rows:
        if not r["agree"] or r["truth"] != "yes" or r["diffs"] != "yes":
            print(f"- {r['template']}: truth {r['truth']} ({r['why'] or 'no break'}; "
                  f"{r['checked']} conversations checked, {len(r['skipped'])} raised)"
                  + (f"; diffs: {r['diffs_why']}" if r["diffs_why"] else ""))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
