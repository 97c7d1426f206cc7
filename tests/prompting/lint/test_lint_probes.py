"""Probes that sample like models: reasoning blocks, whitespace around replies, replies
ending with and without their end-of-turn token, thinking switches, tools passed and not.

Each pattern has a template that fires its rule and one that does not."""

from __future__ import annotations

import lint_templates as T

from prefixgym.prompting.findings import Finding
from prefixgym.prompting.lint.report import render_text
from prefixgym.prompting.templates.append_only import TemplateReport, probe_template
from prefixgym.prompting.templates.prober import end_of_turn_token


def report_of(template: str, eos: str = "<|im_end|>", bos: str = "") -> TemplateReport:
    return probe_template(template, bos, eos)


def finding(report: TemplateReport, rule: str) -> Finding:
    (found,) = [f for f in report.findings if f.rule == rule]
    return found


def test_reasoning_dropped_from_the_sampled_turn_itself_fires_pg101() -> None:
    # The history never shows the reasoning, not even for the turn just sampled: reading
    # the reply off that history (as the probes did) made it look append-only.
    report = report_of(T.DROPS_REASONING)
    assert not report.append_only
    assert [f.rule for f in report.findings] == ["PG101"]
    pg101 = report.findings[0]
    assert "of the reply is dropped" in pg101.message
    assert pg101.extra["only_when"] == ["the reply contains a <think> block"]
    assert "breaks only when the reply contains a <think> block" in pg101.message
    assert "probe 'reasoning <think>'" in pg101.location
    assert pg101.expected is not None and pg101.actual is not None and pg101.caret is not None
    assert pg101.expected[pg101.caret:].startswith("<think>\nThe user adds")
    assert pg101.actual[pg101.caret:].startswith("\n\n2 + 2 = 4.")
    assert report.breaks_by_default == ["PG101"]


def test_reasoning_marker_named_in_the_template_is_probed() -> None:
    # '<reasoning>' is read from the source: the <think> probes alone would miss this
    report = report_of(T.DROPS_REASONING_TAG)
    assert [f.rule for f in report.findings] == ["PG101"]
    assert report.findings[0].extra["only_when"] == ["the reply contains a <reasoning> block"]
    assert "reasoning <reasoning>" in report.probes_checked
    assert "reasoning <reasoning>" not in report_of(T.CHATML).probes_checked


def test_switch_that_opens_think_where_history_closes_it_fires_pg111() -> None:
    report = report_of(T.SWITCH_DROPS_OPENER)
    # without the switch the reasoning itself is dropped: PG101, at the defaults
    assert not report.append_only
    assert [f.rule for f in report.findings] == ["PG101"]
    assert "the reply contains a <think> block" in finding(report, "PG101").extra["only_when"]
    assert report.breaks_by_default == ["PG101"]
    # the switch adds PG111, reported beside the verdict, named and costed
    (pg111,) = report.switches
    assert pg111.rule == "PG111"
    assert (pg111.extra["switch"], pg111.extra["value"]) == ("enable_thinking", True)
    assert "the generation prompt ends '<think>\\n'" in pg111.message
    assert "history renders that turn from there as '</think>" in pg111.message
    assert "[enable_thinking=True]" in pg111.location
    assert pg111.extra["reprefilled_chars_per_turn"] > len("<think>\n")


def test_switch_whose_history_keeps_the_opened_block_is_append_only() -> None:
    report = report_of(T.SWITCH_KEEPS_REASONING)
    assert report.findings == [] and report.append_only
    # with the switch on, the model continues the opened block: only that probe applies
    assert "reasoning <think> [enable_thinking=True]" in report.probes_checked
    assert "plain [enable_thinking=True]" not in report.probes_checked
    assert "plain [enable_thinking=False]" in report.probes_checked


def test_switch_names_and_values_are_read_from_the_template() -> None:
    report = report_of(T.thinking_switch_drops_opener("deep_mode"))
    assert [(f.rule, f.extra["switch"], f.extra["value"]) for f in report.switches] == [
        ("PG111", "deep_mode", True)]
    effort = report_of(T.thinking_switch_drops_opener("reasoning_effort == 'max'"))
    assert [(f.rule, f.extra["switch"], f.extra["value"]) for f in effort.switches] == [
        ("PG111", "reasoning_effort", "max")]
    assert "plain [reasoning_effort='high']" in effort.probes_checked


def test_switch_setting_the_template_raises_on_is_skipped_not_reported() -> None:
    # `items` set to True cannot be iterated: those probes are skipped, the rest is clean
    template = "{%- if items is defined %}{%- for i in items %}{{- i }}{%- endfor %}{%- endif %}" + T.CHATML
    report = report_of(template)
    assert report.findings == [] and report.append_only
    assert "plain [items=True]" in report.probes_skipped
    assert "'bool' object is not iterable" in report.probes_skipped["plain [items=True]"]
    assert "plain" in report.probes_checked


def test_space_before_eos_fires_pg112_for_a_reply_ending_on_eos() -> None:
    # Llama-2-like: ' ' + content.strip() + ' ' + EOS
    report = report_of(T.STRIPS_REPLY, eos="</s>", bos="<s>")
    assert [f.rule for f in report.findings] == ["PG112"]
    pg112 = report.findings[0]
    assert "reply ending on '</s>'" in pg112.location and "probe 'plain'" in pg112.location
    assert "puts ' ' between the reply and its end-of-turn token '</s>'" in pg112.message
    assert pg112.expected is not None and pg112.actual is not None and pg112.caret is not None
    assert pg112.expected[pg112.caret:] == "</s>"
    assert pg112.actual[pg112.caret:].startswith(" </s>[INST]")
    # a SentencePiece space before the reply alone is what the model samples: no break
    assert report_of(T.SENTENCEPIECE_SPACE, eos="</s>", bos="<s>").findings == []


def test_reply_closed_by_text_without_an_end_of_turn_token_ends_on_eos() -> None:
    # 'Answer: a ' then the next question: no token closes the reply, so the model stopped
    # on EOS, and the next prompt does not hold it (the probes used to check only the
    # reply closed by the template's ' ', as if nothing had been sampled to stop it)
    report = report_of(T.QA_WITHOUT_END_OF_TURN, eos="</s>")
    assert not report.append_only
    assert [f.rule for f in report.findings] == ["PG103"]
    pg103 = report.findings[0]
    assert "probe 'plain'" in pg103.location and "reply ending on '</s>'" in pg103.location
    assert pg103.expected is not None and pg103.actual is not None and pg103.caret is not None
    assert pg103.expected[pg103.caret:] == "</s>"
    assert pg103.actual[pg103.caret:].startswith(" Question: And 3 + 3?")
    # without an EOS there is no token known to stop on: the template's closing stands
    assert report_of(T.QA_WITHOUT_END_OF_TURN, eos="").append_only


def test_trimmed_reply_fires_pg112_only_for_replies_with_whitespace_around() -> None:
    report = report_of(T.TRIMS_REPLY)
    assert [f.rule for f in report.findings] == ["PG112"]
    pg112 = report.findings[0]
    assert pg112.extra["only_when"] == [
        "(the reply has newlines around it or the reply has spaces around it)"]
    assert "trims or changes the whitespace around the reply" in pg112.message
    assert pg112.actual is not None and pg112.caret is not None
    assert pg112.actual[pg112.caret:].startswith("2 + 2 = 4.<|im_end|>")
    assert report_of(T.CHATML).findings == []


def test_break_only_with_tools_says_so() -> None:
    report = report_of(T.TOOLS_IN_LAST_USER)
    assert [f.rule for f in report.findings] == ["PG107"]
    assert report.findings[0].extra["only_when"] == ["tools are passed"]
    assert "tools+" in report.findings[0].location


def test_system_break_says_it_needs_a_system_message() -> None:
    assert finding(report_of(T.SYSTEM_IN_LAST_USER), "PG102").extra["only_when"] == [
        "there is a system message"]


def test_end_of_turn_token_is_read_off_the_closing() -> None:
    assert end_of_turn_token("<|im_end|>\n", "") == "<|im_end|>"
    assert end_of_turn_token("<|im_end|>\n<|endoftext|>", "<|endoftext|>") == "<|im_end|>"
    assert end_of_turn_token(" </s>", "</s>") == "</s>"
    assert end_of_turn_token("\n", "\n") == "\n"
    assert end_of_turn_token("\n\n", "") is None


def test_text_summary_counts_checked_and_skipped_probes() -> None:
    template = "{%- if items is defined %}{%- for i in items %}{{- i }}{%- endfor %}{%- endif %}" + T.CHATML
    first_line = render_text(report_of(template)).splitlines()[0]
    # items=True and items=False both cannot be iterated: 2 x 18 probes skipped
    assert first_line == ("<template>: append_only=yes at the template's defaults, 18 probes "
                          "checked, content written as plain strings, 36 skipped (the "
                          "template raised under a switch setting the probes chose)")


LLAMA3_LIKE = (  # Llama 3.x's shape: every message's content trimmed
    "{{- bos_token }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim"
    " + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}")


def test_a_template_trimming_only_edge_whitespace_is_append_only_with_a_warning() -> None:
    """PG112 seen only for replies with whitespace at their edges: a warning naming the
    condition, and append_only holds; `strict` keeps the error and the no."""
    for template, eos in ((T.TRIMS_REPLY, "<|im_end|>"), (LLAMA3_LIKE, "<|eot_id|>")):
        report = probe_template(template, "<|begin_of_text|>", eos)
        assert [(f.rule, f.severity) for f in report.findings] == [("PG112", "warning")]
        assert report.findings[0].extra["condition"] == "the reply has whitespace at its edges"
        assert "graded a warning" in report.findings[0].message and report.append_only
        strict = probe_template(template, "<|begin_of_text|>", eos, strict=True)
        assert [(f.rule, f.severity) for f in strict.findings] == [("PG112", "error")]
        assert not strict.append_only


def test_a_template_that_breaks_plain_replies_stays_an_error() -> None:
    report = report_of(T.STRIPS_REPLY, eos="</s>", bos="<s>")  # ' ' before EOS: every reply
    assert [(f.rule, f.severity) for f in report.findings] == [("PG112", "error")]
    assert not report.append_only
