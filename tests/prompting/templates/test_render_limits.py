"""A runaway chat template is a finding, never a hang: each render runs in a worker
under a time, memory and output limit (PG113); a template that raises on every
probe is not append-only; the adapter refuses a runaway template."""

from __future__ import annotations

import threading
from datetime import datetime
from pathlib import Path

import pytest

from prefixgym.cli.lint import main as lint_main
from prefixgym.prompting.hf_template import HFTemplateFormat
from prefixgym.prompting.templates.append_only import probe_template
from prefixgym.prompting.templates.render import (
    RenderError,
    RenderLimitError,
    RenderLimits,
    TemplateRenderer,
)
from prefixgym.prompting.tokenizer import builtin_chat_template, load_tokenizer

FAST = RenderLimits(seconds=2.0, output_chars=100_000, memory_bytes=256 << 20)
LOOPS = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
         "{{ messages[0].content }}")
DOUBLES = ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
           "{% endfor %}{{ ns.s | length }}")
FLOODS = "{% for i in range(10000) %}{{ 'x' * 100 }}{% endfor %}"
OK = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"


@pytest.mark.parametrize(("template", "limit"), [
    (LOOPS, "longer than 2 s"),
    (DOUBLES, ""),  # memory or time, whichever this machine reaches first
    (FLOODS, "1,000,000 characters, more than the limit of 100,000"),
])
def test_a_runaway_template_is_a_pg113_finding(template: str, limit: str) -> None:
    report = probe_template(template, "", "", limits=FAST)
    assert not report.append_only and report.probes_checked == []
    [finding] = [f for f in report.findings if f.rule == "PG113"]
    assert limit in finding.message
    assert len(finding.extra["probes_not_checked"]) > 1  # the rest are not waited out
    assert not any(f.rule == "PG109" for f in report.findings)


def test_the_worker_renders_again_after_a_limit() -> None:
    runaway = TemplateRenderer(LOOPS, "", "", limits=FAST)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(RenderLimitError, match="longer than 2 s"):
        runaway.render(messages, False)
    with pytest.raises(RenderLimitError):  # refused at once from now on
        runaway.render(messages, False)
    ok = TemplateRenderer(OK, "", "", limits=FAST)
    assert ok.render(messages, False, clock=datetime(2024, 1, 1)) == "<user>hi</user>"


def test_a_template_that_raises_on_every_probe_is_not_append_only() -> None:
    report = probe_template("{{ raise_exception('never') }}", "", "")
    assert report.probes_checked == [] and not report.append_only
    assert {f.rule for f in report.findings} == {"PG109"}


def test_the_builtin_template_still_passes() -> None:
    report = probe_template(builtin_chat_template(), "", "<|im_end|>")
    assert report.append_only and report.findings == [] and report.probes_checked


OVER_THE_OUTPUT_LIMIT = FLOODS.replace("'x' * 100", "'x' * 1000")  # 10,000,000 characters


def test_the_chat_template_adapter_refuses_a_runaway_template() -> None:
    with pytest.raises(ValueError, match="rendering exceeded a limit"):
        HFTemplateFormat(load_tokenizer(), OVER_THE_OUTPUT_LIMIT)


def test_a_template_running_away_on_one_conversation_fails_that_render() -> None:
    # The probes pass; the turn whose text is BOOM asks for 40 GB. Rendered in this
    # process, it would take the machine; in the worker it is a ValueError.
    template = ("{% for m in messages %}<{{ m.role }}>{% if m.content == 'BOOM' %}"
                "{{ m.content * 10000000000 }}{% else %}{{ m.content }}{% endif %}"
                "</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    fmt = HFTemplateFormat(load_tokenizer(), template)
    history = [{"role": "user", "content": "hi"}]
    assert fmt.render_message("user", "fine", history=history) == \
        fmt.tokenizer.encode("<user>fine</user>", add_special_tokens=False)
    with pytest.raises(ValueError, match="rendering exceeded a limit .*on 2 messages"):
        fmt.render_message("user", "BOOM", history=history)


def test_lint_template_reports_a_runaway_template_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "runaway.jinja"
    path.write_text(OVER_THE_OUTPUT_LIMIT)  # over the 8,000,000 characters a render may produce
    assert lint_main(["template", str(path)]) == 1
    out = capsys.readouterr().out
    assert "PG113" in out and "append_only=no" in out


def test_a_spawned_worker_reports_a_template_error_and_lives_on() -> None:
    # With other threads running the worker is a new interpreter (`-m render_worker`),
    # not a fork; a template's error there was once another RenderError class, which
    # killed the worker and read as a limit hit.
    from prefixgym.prompting.templates import render_worker

    limits = RenderLimits(seconds=30.0, output_chars=100_000, memory_bytes=256 << 20)
    messages = [{"role": "user", "content": "hi"}]
    clock = datetime(2024, 1, 1)
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        with pytest.raises(RenderError, match="TemplateError: never") as raised:
            render_worker.render("{{ raise_exception('never') }}", messages, False, None, clock,
                                 {}, limits)
        assert not isinstance(raised.value, RenderLimitError)
        worker = render_worker._worker
        assert worker is not None and worker.process is not None  # spawned, not forked
        assert render_worker.render(OK, messages, False, None, clock, {}, limits) == \
            "<user>hi</user>"
        assert render_worker._worker is worker  # the same worker answered
    finally:
        release.set()
        other.join()
