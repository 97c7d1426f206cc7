"""The template probe: each kind of break fires its own rule, an append-only template none."""

from __future__ import annotations

import lint_templates as T
import pytest

from prefixgym.prompting.findings import LintInputError
from prefixgym.prompting.templates.append_only import probe_template


def rules(template: str, eos: str = "<|im_end|>", bos: str = "") -> set[str]:
    return {f.rule for f in probe_template(template, bos, eos).findings}


def test_chatml_is_append_only_and_clean() -> None:
    report = probe_template(T.CHATML, "", "<|im_end|>")
    assert report.append_only
    assert report.findings == []
    # {no system, system} x {no tools, tools} x {plain, <think>, spaces, newlines}, and
    # the tool call with tools: the template reads no switch, so only its defaults
    assert len(report.probes_checked) == 18
    assert {"plain", "system+tools+reasoning <think>", "tools+spaces", "newlines",
            "system+tools+tool-call"} <= set(report.probes_checked)
    assert report.probes_skipped == {} and report.breaks_by_default == []
    assert report.closing == "<|im_end|>\n"
    assert report.reads_date is False


def test_reasoning_stripped_from_earlier_turns_fires_pg101() -> None:
    report = probe_template(T.STRIPS_THINK, "", "<|im_end|>")
    assert not report.append_only
    assert [f.rule for f in report.findings] == ["PG101"]
    finding = report.findings[0]
    assert finding.expected is not None and finding.actual is not None
    caret = finding.caret or 0
    assert finding.expected[caret:].startswith("<think>")
    assert not finding.actual[caret:].startswith("<think>")
    assert "reasoning" in report.findings[0].message


def test_system_prompt_moved_to_last_user_fires_pg102() -> None:
    assert rules(T.SYSTEM_IN_LAST_USER) == {"PG102"}
    assert "PG102" not in rules(T.CHATML)


def test_end_of_turn_rendered_differently_fires_pg103() -> None:
    report = probe_template(T.END_OF_TURN_CHANGES, "", "<|return|>")
    assert {f.rule for f in report.findings} == {"PG103"}
    finding = report.findings[0]
    assert finding.expected is not None and finding.actual is not None
    assert finding.expected.endswith("<|return|>")
    assert "<|end|>" in finding.actual


def test_eos_appended_to_history_fires_pg104() -> None:
    assert rules(T.EOS_IN_HISTORY, eos="<|endoftext|>") == {"PG104"}


def test_whitespace_change_fires_pg105_at_the_newline() -> None:
    report = probe_template(T.WHITESPACE_CHANGES, "", "<|im_end|>")
    assert {f.rule for f in report.findings} == {"PG105"}
    finding = report.findings[0]
    assert finding.actual is not None and finding.caret is not None
    assert finding.actual[finding.caret] == "\n"


def test_system_role_refused_fires_pg106_and_checks_the_rest() -> None:
    report = probe_template(T.REFUSES_SYSTEM, "", "<|im_end|>")
    assert {f.rule for f in report.findings} == {"PG106"}
    assert "System role not supported" in report.findings[0].message
    assert len(report.probes_checked) == 9
    assert not any(name.startswith("system+") for name in report.probes_checked)
    assert report.append_only


def test_strftime_now_fires_pg108_but_renders_stay_append_only() -> None:
    report = probe_template(T.READS_DATE, "", "<|im_end|>")
    assert {f.rule for f in report.findings} == {"PG108"}
    assert report.reads_date and report.append_only
    finding = report.findings[0]
    assert finding.expected is not None and "2024" in finding.expected
    assert finding.actual is not None and "2025" in finding.actual


def test_date_variable_read_statically_fires_pg108() -> None:
    template = "{{- 'Today: ' + (date_string if date_string is defined else '26 Jul 2024') }}" + T.CHATML
    assert rules(template) == {"PG108"}


def test_sentencepiece_space_after_generation_prompt_is_not_a_break() -> None:
    report = probe_template(T.SENTENCEPIECE_SPACE, "<s>", "</s>")
    assert report.findings == []
    assert report.append_only


def test_earlier_message_rendered_differently_fires_pg107() -> None:
    # a user message is upper-cased once it is no longer the last message
    template = T.CHATML.replace(
        "m.content }}", "(m.content | upper if m.role == 'user' and not loop.last else m.content) }}"
    )
    report = probe_template(template, "", "<|im_end|>")
    assert {f.rule for f in report.findings} == {"PG107"}
    assert not report.append_only


def test_template_raising_on_tool_role_fires_pg109() -> None:
    template = "{%- for m in messages %}{%- if m.role == 'tool' %}{{ raise_exception('no tools') }}" \
               "{%- endif %}{%- endfor %}" + T.CHATML
    report = probe_template(template, "", "<|im_end|>")
    assert {f.rule for f in report.findings} == {"PG109"}
    assert "tools" not in report.probes_checked


def test_syntax_error_is_a_lint_input_error_with_line() -> None:
    with pytest.raises(LintInputError, match=r"<template>:2: template does not compile"):
        probe_template("ok\n{% for m in messages %}{{ m.content }", "", "")


class _CharTokenizer:
    """Merges '\\n\\n' into one token, so that '\\n' + '\\n...' tokenizes differently whole."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            if text.startswith("\n\n", i):
                ids.append(1000)
                i += 2
            else:
                ids.append(ord(text[i]))
                i += 1
        return ids

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return ["\n\n" if i == 1000 else chr(i) for i in ids]


def test_token_boundary_merge_fires_pg110_only_with_a_tokenizer() -> None:
    # Turns are separated by a blank line; the reply ends with its own '\n' (EOS here),
    # so as text the next prompt extends prompt + reply, but tokenized whole the two
    # newlines merge into one '\n\n' token.
    template = (
        "{%- for m in messages %}{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
        "{{- m.role + ': ' + m.content + '\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '\\nassistant: ' }}{%- endif %}"
    )
    assert rules(template, eos="\n") == set()
    report = probe_template(template, "", "\n", tokenizer=_CharTokenizer())
    assert {f.rule for f in report.findings} == {"PG110"}
    assert report.findings[0].extra["expected_ids"][0] == ord("\n")
    assert report.findings[0].extra["actual_ids"][0] == 1000
    assert report.append_only


def test_a_break_says_what_it_prefills_again_each_turn() -> None:
    # STRIPS_THINK drops the reasoning block once the reply is history: everything from
    # the block on (the reply and its end of turn) was cached and is prefilled again
    from prefixgym.prompting.templates.probes import ANSWERS, REASONING

    reply = f"<think>\n{REASONING[0]}\n</think>\n\n{ANSWERS[0]}"
    [plain] = probe_template(T.STRIPS_THINK, "", "<|im_end|>").findings
    assert plain.extra["reprefilled_chars_per_turn"] == len(reply + "<|im_end|>\n")
    assert "reprefilled_tokens_per_turn" not in plain.extra  # no tokenizer, no tokens
    [tokens] = [f for f in probe_template(T.STRIPS_THINK, "", "<|im_end|>",
                                          tokenizer=_CharTokenizer()).findings
                if f.rule == "PG101"]
    # one character per token, but the '\n\n' after </think> is one
    assert tokens.extra["reprefilled_tokens_per_turn"] == len(reply + "<|im_end|>\n") - 1
