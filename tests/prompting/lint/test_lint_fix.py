"""`lint template --fix`: an append-only variant of a template that is not (each reply in the
history as it was sampled), linted again, its latest turn as the original's; or the reason
there is none."""

from __future__ import annotations

import json
from pathlib import Path

import lint_templates as T
import pytest
from chat_templates import QWEN3_LATEST_THINK, QWEN3_LIKE

from prefixgym.cli.lint import main
from prefixgym.prompting.templates.append_only import probe_template
from prefixgym.prompting.templates.fix import TemplateFix, fix_template
from prefixgym.prompting.templates.probes import ANSWERS, QUESTIONS, REASONING
from prefixgym.prompting.templates.render import TemplateRenderer

REASONED = f"<think>\n{REASONING[0]}\n</think>\n\n{ANSWERS[0]}"
FIXABLE = {  # name: (template, eos)
    "QWEN3_LIKE": (QWEN3_LIKE, "<|im_end|>"),
    "QWEN3_LATEST_THINK": (QWEN3_LATEST_THINK, "<|im_end|>"),
    "STRIPS_THINK": (T.STRIPS_THINK, "<|im_end|>"),
    "DROPS_REASONING": (T.DROPS_REASONING, "<|im_end|>"),
    "DROPS_REASONING_TAG": (T.DROPS_REASONING_TAG, "<|im_end|>"),
    "SWITCH_DROPS_OPENER": (T.SWITCH_DROPS_OPENER, "<|im_end|>"),
    "WHITESPACE_CHANGES": (T.WHITESPACE_CHANGES, "<|im_end|>"),
    "END_OF_TURN_CHANGES": (T.END_OF_TURN_CHANGES, "<|return|>"),
    "STRIPS_REPLY": (T.STRIPS_REPLY, "</s>"),
}


def fixed(template: str, eos: str, kwargs: dict | None = None) -> TemplateFix:
    report = probe_template(template, "<s>", eos, template_kwargs=kwargs)
    assert not report.append_only
    return fix_template(template, report, "<s>", eos)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.mark.parametrize("name", sorted(FIXABLE))
def test_the_variant_is_append_only_and_renders_the_latest_turn_as_the_original(name: str) -> None:
    template, eos = FIXABLE[name]
    fix = fixed(template, eos)
    assert fix.variant is not None and fix.refused == ""
    assert fix.report is not None and fix.report.append_only
    assert probe_template(fix.variant, "<s>", eos).append_only  # linted again, alone
    original = TemplateRenderer(template, "<s>", eos)
    variant = TemplateRenderer(fix.variant, "<s>", eos)
    # a first question and its generation prompt: the original's text exactly
    for messages in ([user(QUESTIONS[0])],
                     [{"role": "system", "content": "Be brief."}, user(QUESTIONS[0])]):
        for generation in (False, True):
            assert variant.render(messages, generation) == original.render(messages, generation)
    # a later question: the original's text for it and the generation prompt, after the reply
    history = [user(QUESTIONS[0]), assistant(REASONED)]
    ours = variant.render([*history, user(QUESTIONS[1])], True)
    before = variant.render(history, False)
    assert ours.startswith(before)
    theirs = original.render([user(QUESTIONS[0]), assistant("Done."), user(QUESTIONS[1])], True)
    assert theirs.endswith(ours[len(before):])
    assert REASONING[0] in ours  # the reply as sampled, reasoning kept


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}])
def test_qwen3s_variant_keeps_reasoning_and_its_latest_reply_is_the_originals(kwargs) -> None:
    fix = fixed(QWEN3_LIKE, "<|im_end|>", kwargs)
    assert fix.variant is not None and fix.report is not None
    assert fix.report.append_only and fix.report.settings == (kwargs or {})
    variables = kwargs or {}
    original = TemplateRenderer(QWEN3_LIKE, "", "<|im_end|>", variables=variables)
    variant = TemplateRenderer(fix.variant, "", "<|im_end|>", variables=variables)
    reply = REASONED if kwargs is None else ANSWERS[0]  # thinking off: no block sampled
    header = "<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if kwargs else "")
    # the latest reply, as the model sampled it after the generation prompt
    latest = [user(QUESTIONS[0]), assistant(reply)]
    assert variant.render(latest, False).endswith(header + reply + "<|im_end|>\n")
    if kwargs is None:  # the original renders the latest reply as sampled too
        assert variant.render(latest, False) == original.render(latest, False)
    else:  # the original's history drops the empty block its generation prompt wrote
        assert "</think>" not in original.render(latest, False)
    # once a question follows, the original strips the reasoning; the variant keeps it
    longer = [*latest, user(QUESTIONS[1])]
    if kwargs is None:
        assert REASONING[0] not in original.render(longer, True)
    assert variant.render(longer, True).startswith(variant.render(latest, False))
    assert fix.diff.startswith("--- <template>\n+++ <fixed>\n")


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}])
def test_a_template_that_rewrites_the_latest_reply_once_a_question_follows_is_fixed(
        kwargs) -> None:
    """Qwen3's shape: the latest reply gets a think block (empty, without reasoning) that
    it loses once a question follows; each question's text is what the longer rendering
    inserts, and the latest reply renders as the original's."""
    fix = fixed(QWEN3_LATEST_THINK, "<|im_end|>", kwargs)
    assert fix.variant is not None and fix.report is not None and fix.report.append_only
    variables = kwargs or {}
    original = TemplateRenderer(QWEN3_LATEST_THINK, "", "<|im_end|>", variables=variables)
    variant = TemplateRenderer(fix.variant, "", "<|im_end|>", variables=variables)
    reply = ANSWERS[0] if kwargs else REASONED
    sampled = ("<think>\n\n</think>\n\n" if kwargs else "") + reply  # prompt + sample
    latest = [{"role": "system", "content": "Be brief."}, user(QUESTIONS[0]), assistant(reply)]
    assert variant.render(latest, False) == original.render(
        [*latest[:-1], assistant(sampled)], False)
    longer = [*latest, user(QUESTIONS[1])]
    assert variant.render(longer, True) == variant.render(latest, False) + (
        f"<|im_start|>user\n{QUESTIONS[1]}<|im_end|>\n<|im_start|>assistant\n"
        + ("<think>\n\n</think>\n\n" if kwargs else ""))


@pytest.mark.parametrize(("name", "eos", "reason"), [
    ("EOS_IN_HISTORY", "<|endoftext|>",
     "the generation prompt does not extend the rendering of the messages before it"),
    ("SYSTEM_IN_LAST_USER", "<|im_end|>", "would render the latest turn otherwise"),
    ("TOOLS_IN_LAST_USER", "<|im_end|>",
     "adding a user message changes the rendering of the messages before it"),
])
def test_where_the_template_rewrites_other_messages_it_refuses_with_the_reason(
        name: str, eos: str, reason: str) -> None:
    fix = fixed(getattr(T, name), eos)
    assert fix.variant is None and reason in fix.refused


def test_an_append_only_template_needs_no_fix() -> None:
    report = probe_template(T.CHATML, "", "<|im_end|>")
    fix = fix_template(T.CHATML, report, "", "<|im_end|>")
    assert fix.variant is None and "append-only at these settings already" in fix.refused


def test_the_command_writes_the_variant_shows_the_diff_and_lints_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen.jinja").write_text(QWEN3_LIKE)
    out = tmp_path / "qwen-fixed.jinja"
    base = ["template", "qwen.jinja", "--eos-token", "<|im_end|>"]
    assert main([*base, "--fix", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("qwen.jinja: append_only=no")  # the original's report first
    assert f"+++ {out}" in text and "+{% macro prefixgym_original" in text
    assert f"--fix: wrote {out}: append_only=yes at the template's defaults" in text
    assert main(["template", str(out), "--eos-token", "<|im_end|>"]) == 0
    capsys.readouterr()
    assert main([*base, "--fix", str(out), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["append_only"] is False and data["fix"]["path"] == str(out)
    assert data["fix"]["report"]["append_only"] is True and data["fix"]["refused"] is None
    # refused: nothing written, the reason said, exit 1
    (tmp_path / "eos.jinja").write_text(T.EOS_IN_HISTORY)
    refused = tmp_path / "eos-fixed.jinja"
    assert main(["template", "eos.jinja", "--eos-token", "<|endoftext|>", "--fix", str(refused)]) == 1
    assert "--fix: no variant written: the generation prompt does not extend" in (
        capsys.readouterr().out)
    assert not refused.exists()
    # an append-only template: nothing to fix, nothing written, the verdict's exit code
    (tmp_path / "chatml.jinja").write_text(T.CHATML)
    assert main(["template", "chatml.jinja", "--fix", str(refused)]) == 0
    assert "--fix: nothing to fix: the template is append-only" in capsys.readouterr().out
    assert not refused.exists()


def test_a_conversation_builds_the_variants_prompts_token_for_token() -> None:
    from prefixgym.prompting import Conversation, HFTemplateFormat
    from prefixgym.prompting.tokenizer import load_tokenizer

    tok = load_tokenizer()
    fix = fixed(QWEN3_LIKE, "<|im_end|>")
    assert fix.variant is not None
    fmt = HFTemplateFormat(tok, fix.variant)
    assert fmt.template_mismatch == [] and fmt.template_report is not None
    assert fmt.template_report.append_only
    conv = Conversation(tok, system="Be brief.", chat_format=fmt)
    for question, reply in ((QUESTIONS[0], REASONED), (QUESTIONS[1], ANSWERS[1])):
        conv.add_user(question)
        conv.generation_prompt()
        conv.add_sampled(tok.encode(reply + "<|im_end|>", add_special_tokens=False),
                         stop_reason="stop")
    conv.add_user("Thanks!")
    assert conv.extension_ok
    rendered = tok.apply_chat_template(conv.messages, chat_template=fix.variant, tokenize=False)
    assert REASONING[0] in rendered
    assert conv.tokens == list(tok.encode(rendered, add_special_tokens=False))
