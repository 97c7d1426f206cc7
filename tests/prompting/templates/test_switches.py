"""What a template reads besides the messages: reasoning markers and switch variables."""

from __future__ import annotations

from prefixgym.prompting.templates.render import TemplateRenderer
from prefixgym.prompting.templates.switches import (
    MAX_SWITCHES,
    Marker,
    reasoning_markers,
    switch_settings,
)


def labels(template: str) -> list[str]:
    return [s.label for s in switch_settings(TemplateRenderer(template, "", "").syntax_tree)]


def test_think_is_always_probed_and_other_markers_come_from_the_source() -> None:
    assert reasoning_markers("{{ messages }}") == [Marker("<think>", "</think>")]
    source = ("{{ c.split('</reasoning>')[-1] }}{{ '[/THINK]' }}{{ '<|END_THINKING|>' }}"
              "{{ '<|end_of_thought|>' }}{{ '</seed:think>' }}{{ '</tool_call>' }}{{ '</think>' }}")
    assert reasoning_markers(source) == [
        Marker("<think>", "</think>"), Marker("<reasoning>", "</reasoning>"),
        Marker("<seed:think>", "</seed:think>"), Marker("[THINK]", "[/THINK]"),
        Marker("<|START_THINKING|>", "<|END_THINKING|>"),
        Marker("<|begin_of_thought|>", "<|end_of_thought|>"),
    ]


def test_every_switch_is_tried_both_ways_and_with_the_values_it_is_compared_with() -> None:
    template = (
        "{%- if reasoning_effort is not defined %}{%- set reasoning_effort = 'medium' %}{%- endif %}"
        "{{- reasoning_effort }}"
        "{%- if enable_thinking is defined and enable_thinking is false %}x{%- endif %}"
        "{%- if mode in ['fast', 'slow'] %}y{%- endif %}"
        "{%- for m in messages %}{{- m.content + bos_token + eos_token }}{%- endfor %}"
        "{%- if add_generation_prompt %}{%- endif %}"
    )
    assert labels(template) == [
        "enable_thinking=True", "enable_thinking=False",
        "reasoning_effort=True", "reasoning_effort=False",
        "reasoning_effort='low'", "reasoning_effort='medium'", "reasoning_effort='high'",
        "mode=True", "mode=False", "mode='fast'", "mode='slow'",
    ]


def test_locals_the_template_sets_itself_are_not_switches() -> None:
    # `system` is set in both branches of an if: Jinja calls it undeclared, but it is a local
    template = ("{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}"
                "{%- else %}{%- set system = none %}{%- endif %}{{- system }}{{- date_string }}")
    assert labels(template) == []


def test_the_number_of_switches_is_capped() -> None:
    template = "".join(f"{{{{ v{i} }}}}" for i in range(MAX_SWITCHES + 3))
    assert len(labels(template)) == 2 * MAX_SWITCHES
