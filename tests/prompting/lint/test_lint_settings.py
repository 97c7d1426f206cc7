"""The verdict is for the settings a run passes: a switch that breaks the prefix only when
set otherwise is reported beside it, not in it; and templates are probed in the content
shape they read (plain strings, or lists of text parts)."""

from __future__ import annotations

import lint_templates as T
import pytest
from chat_templates import GRANITE_LIKE, LIST_CONTENT, QWEN3_LIKE

from prefixgym.prompting.lint.report import render_text
from prefixgym.prompting.templates.append_only import probe_template
from prefixgym.prompting.templates.content import describe, read_shapes, shaped

GRANITE_EOS = "<|end_of_text|>"


def test_granite_is_append_only_at_its_defaults_and_its_controls_switch_is_reported() -> None:
    report = probe_template(GRANITE_LIKE, "", GRANITE_EOS)
    assert report.append_only and report.settings == {}
    assert [(f.rule, f.severity) for f in report.findings] == [("PG108", "warning")]
    (controls,) = report.switches
    assert (controls.rule, controls.extra["switch"], controls.extra["value"]) == (
        "PG107", "controls", True)
    # a whole turn is prefilled again: ' true<|end_of_role|>' + the reply + its end of turn
    assert controls.extra["reprefilled_chars_per_turn"] == len(
        " true<|end_of_role|>" + "2 + 2 = 4." + GRANITE_EOS)
    text = render_text(report)
    assert text.splitlines()[0].startswith("<template>: append_only=yes at the template's defaults")
    assert ("switch controls=True breaks the prefix: PG107 error [history-rewritten] "
            in text.splitlines()[1])
    assert "cost: 45 characters prefilled again per turn" in text.splitlines()[1]


def test_the_verdict_follows_the_settings_passed() -> None:
    report = probe_template(GRANITE_LIKE, "", GRANITE_EOS,
                            template_kwargs={"controls": {"length": "short"}})
    assert not report.append_only and report.settings == {"controls": {"length": "short"}}
    assert [f.rule for f in report.findings] == ["PG107", "PG108"]
    assert report.breaks_by_default == ["PG107"] and report.switches == []
    assert render_text(report).startswith(
        '<template>: append_only=no at {"controls": {"length": "short"}}')


def test_a_switch_value_the_run_passes_is_not_probed_again_and_the_others_are() -> None:
    report = probe_template(T.SWITCH_DROPS_OPENER, "", "<|im_end|>",
                            template_kwargs={"enable_thinking": True})
    assert not report.append_only and [f.rule for f in report.findings] == ["PG111"]
    assert not any("[enable_thinking=True]" in name for name in report.probes_checked)
    assert [(f.rule, f.extra["switch"], f.extra["value"]) for f in report.switches] == [
        ("PG101", "enable_thinking", False)]


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": True}, {"enable_thinking": False}])
def test_qwen3_breaks_at_every_setting(kwargs: dict[str, bool] | None) -> None:
    report = probe_template(QWEN3_LIKE, "", "<|im_end|>", template_kwargs=kwargs)
    assert not report.append_only and report.breaks_by_default == ["PG101"]


@pytest.mark.parametrize(("name", "append_only"), [
    ("CHATML", True), ("STRIPS_THINK", False), ("SYSTEM_IN_LAST_USER", False),
    ("END_OF_TURN_CHANGES", False), ("EOS_IN_HISTORY", False), ("WHITESPACE_CHANGES", False),
    ("REFUSES_SYSTEM", True), ("READS_DATE", True), ("SENTENCEPIECE_SPACE", True),
    ("DROPS_REASONING", False), ("SWITCH_DROPS_OPENER", False), ("SWITCH_KEEPS_REASONING", True),
    ("STRIPS_REPLY", False), ("TRIMS_REPLY", True), ("DROPS_REASONING_TAG", False),
    ("TOOLS_IN_LAST_USER", False),
])
def test_the_test_templates_keep_their_verdicts(name: str, append_only: bool) -> None:
    report = probe_template(getattr(T, name), "<s>", "<|im_end|>")
    assert report.append_only is append_only
    assert report.content == {"system": "strings", "user": "strings", "assistant": "strings",
                              "tool": "strings"}


def test_a_list_content_template_is_probed_with_text_parts() -> None:
    report = probe_template(LIST_CONTENT, "", "<|im_end|>")
    assert report.append_only and report.findings == []
    assert set(report.content.values()) == {"parts"}
    assert 'content written as lists of {"type": "text"} parts' in render_text(report)
    # probed in parts, its breaks are still found
    strips = LIST_CONTENT.replace(
        "{{- part['text'] -}}",
        "{{- part['text'].split('</think>')[-1] if m.role == 'assistant' else part['text'] -}}")
    assert probe_template(strips, "", "<|im_end|>").breaks_by_default == ["PG101"]


def test_content_shapes_are_read_per_role() -> None:
    from prefixgym.prompting.templates.render import TemplateRenderer

    mixed = T.CHATML.replace(
        "m.content }}", "(m.content if m.role == 'assistant' else m.content[0].text) }}")
    renderer = TemplateRenderer(mixed, "", "")
    shapes = read_shapes(lambda messages: renderer.render(messages, False))
    assert shapes == {"system": "parts", "user": "parts", "assistant": "strings", "tool": "parts"}
    assert describe(shapes) == ('lists of {"type": "text"} parts for system, tool, user, '
                                "plain strings otherwise")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    assert shaped(messages, shapes) == [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": ""}]
    assert probe_template(mixed, "", "<|im_end|>").append_only
