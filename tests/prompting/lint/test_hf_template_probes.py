"""`HFTemplateFormat` runs the linter's probes: it refuses what `lint template` calls a
break under the template's defaults, with the same rule and reason, and accepts the rest."""

from __future__ import annotations

import lint_templates as T
import pytest

from prefixgym.prompting import Conversation, HFTemplateFormat, TemplateNotAppendOnlyError
from prefixgym.prompting.templates.append_only import probe_template
from prefixgym.prompting.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.mark.parametrize("name", ["STRIPS_THINK", "DROPS_REASONING", "SWITCH_DROPS_OPENER",
                                  "DROPS_REASONING_TAG", "TOOLS_IN_LAST_USER",
                                  "EOS_IN_HISTORY", "WHITESPACE_CHANGES"])
def test_a_strict_adapter_refuses_with_the_linters_rule_and_reason(tok, name):
    template = getattr(T, name)
    report = probe_template(template, tok.bos_token, tok.eos_token)
    expected = report.first_default_break()
    assert expected is not None
    with pytest.raises(TemplateNotAppendOnlyError) as info:
        HFTemplateFormat(tok, template, strict=True)
    err = info.value
    assert err.rule == expected.rule
    assert err.reason.startswith(expected.message)
    assert err.index == expected.first_divergence
    assert expected.expected is not None and expected.caret is not None
    assert err.earlier_text == expected.expected[: expected.caret + 40]


@pytest.mark.parametrize("name", ["STRIPS_THINK", "DROPS_REASONING", "SWITCH_DROPS_OPENER",
                                  "DROPS_REASONING_TAG", "WHITESPACE_CHANGES"])
def test_a_template_rewriting_earlier_replies_is_used_turn_by_turn(tok, name):
    """What it breaks touches earlier replies (their reasoning, the space before them):
    used turn by turn, the linter's findings kept as the mismatch to report."""
    template = getattr(T, name)
    report = probe_template(template, tok.bos_token, tok.eos_token)
    fmt = HFTemplateFormat(tok, template)
    assert [f.rule for f in fmt.template_mismatch] == [
        f.rule for f in report.findings if f.rule in report.breaks_by_default]


@pytest.mark.parametrize("name", ["TOOLS_IN_LAST_USER", "EOS_IN_HISTORY"])
def test_a_template_that_breaks_turn_by_turn_too_is_refused(tok, name):
    """One that renders a message by its position (the tools in the last user message,
    an end marker after the last message) cannot be used even turn by turn."""
    template = getattr(T, name)
    expected = probe_template(template, tok.bos_token, tok.eos_token).first_default_break()
    with pytest.raises(TemplateNotAppendOnlyError) as info:
        HFTemplateFormat(tok, template)
    assert expected is not None and info.value.rule == expected.rule
    with pytest.raises(TemplateNotAppendOnlyError):
        Conversation(tok, system="S", chat_template=template)


@pytest.mark.parametrize("name", ["TRIMS_REPLY", "STRIPS_REPLY"])
def test_reply_trimming_templates_are_a_lint_finding_but_a_conversation_is_unaffected(tok, name):
    # the linter reports PG112 (re-rendering history trims a reply sampled with
    # whitespace), but a Conversation keeps the sampled ids, so its prompts still extend
    template = getattr(T, name)
    report = probe_template(template, tok.bos_token, tok.eos_token)
    assert report.first_default_break() is not None
    assert report.first_default_break().rule == "PG112"
    conv = Conversation(tok, system="S", chat_template=template)
    conv.add_user("hi")
    prompt = conv.generation_prompt()
    reply = tok.encode("  yes \n", add_special_tokens=False)
    conv.add_sampled(reply, stop_reason="length")
    conv.add_user("more")
    assert conv.generation_prompt().tokens[: prompt.length + len(reply)] == prompt.tokens + reply
    assert conv.extension_ok


def test_break_only_under_a_switch_the_adapter_never_passes_is_accepted(tok):
    # enable_thinking=True opens <think> that the history does not render; the adapter
    # renders with the template's defaults, where every probe extends
    template = T.thinking_switch_drops_opener("enable_thinking").replace(
        "('</think>' + c.split('</think>')[-1] if '</think>' in c else c)", "c")
    report = probe_template(template, tok.bos_token, tok.eos_token)
    assert report.findings == [] and report.breaks_by_default == [] and report.append_only
    assert [(f.rule, f.extra["switch"]) for f in report.switches] == [("PG111", "enable_thinking")]
    fmt = HFTemplateFormat(tok, template)
    assert fmt.template_report is not None and fmt.template_report.append_only
    conv = Conversation(tok, system="S", chat_format=fmt)
    conv.add_user("hi")
    conv.add_sampled(tok.encode("<think>\nok\n</think>\n\nyes<|im_end|>", add_special_tokens=False),
                     stop_reason="stop")
    conv.add_user("more")
    assert conv.extension_ok
    assert conv.tokens == list(tok.apply_chat_template(
        conv.messages, chat_template=template, tokenize=True, return_dict=False))


def test_append_only_templates_are_accepted_and_closing_comes_from_the_probes(tok):
    for template in (T.CHATML, T.SWITCH_KEEPS_REASONING, tok.chat_template):
        fmt = HFTemplateFormat(tok, template)
        assert fmt.end_of_turn() == [2, *tok.encode("\n", add_special_tokens=False)]
        assert fmt.end_of_turn_token_id == 2


def test_a_list_content_template_gets_text_parts_and_its_verdict_is_kept(tok):
    from chat_templates import LIST_CONTENT

    fmt = HFTemplateFormat(tok, LIST_CONTENT)
    assert fmt.template_report is not None and fmt.template_report.append_only
    conv = Conversation(tok, system="S", chat_format=fmt)
    conv.add_user("hi")
    conv.add_sampled(tok.encode("yes<|im_end|>", add_special_tokens=False), stop_reason="stop")
    conv.add_user("more")
    assert conv.extension_ok
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in conv.messages]
    assert conv.tokens == list(tok.apply_chat_template(
        parts, chat_template=LIST_CONTENT, tokenize=True, return_dict=False))


def test_template_that_renders_no_probe_is_a_value_error(tok):
    with pytest.raises(ValueError, match="failed to render the probe conversations: .*nope"):
        HFTemplateFormat(tok, "{{ raise_exception('nope') }}")
