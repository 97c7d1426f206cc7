"""Tool-call syntax per template family: detection, parsing, formatting, round trips.

The templates below are small, written here, and carry the lines that real templates
(Qwen2.5, Llama 3.1, Mistral v0.3, Mistral Small 3.2, gpt-oss, Granite 3.x and 4, OLMo 3.1
Instruct) use to write an assistant's tool calls, so that `format` is checked against
what the template renders, and the markers by which `syntax_for_template` tells them
apart from the families without a tool syntax (Gemma, OLMo 2, Phi-3/3.5/4, Phi-4-mini's
official template)."""

from __future__ import annotations

from typing import Any

import pytest

from prefixgym.prompting.templates.jinja_render import CLOCK_A, render_in_process
from prefixgym.prompting.tokenizer import builtin_chat_template
from prefixgym.prompting.tool_syntax import (
    GptOssSyntax,
    GraniteSyntax,
    HermesSyntax,
    Llama3JsonSyntax,
    MistralSyntax,
    Olmo3Syntax,
    ParsedCall,
    Phi4MiniSyntax,
    ToolCallSyntax,
    syntax_for_template,
)
from prefixgym.prompting.tools import format_tool_call

QWEN_LIKE = """{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}
{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}
{{- '</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, \
"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}{%- endif %}
{%- for message in messages %}{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}{%- endfor %}"""

LLAMA31_LIKE = """{%- for message in messages %}{%- if 'tool_calls' in message %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{{- '{"name": "' + tool_call.name + '", ' }}{{- '"parameters": ' }}
{{- tool_call.arguments | tojson }}{{- "}" }}{{- "<|eot_id|>" }}
{%- elif message.role == 'ipython' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n<|python_tag|>' + message.content }}
{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}
{{- 'Given the following functions, please respond with a JSON for a function call.' }}
{%- endif %}{%- endfor %}"""

MISTRAL_V03_LIKE = """{%- for message in messages %}{%- if message.role == 'user' %}
{{- '[INST] ' + message.content + '[/INST]' }}
{%- elif message.tool_calls is defined and message.tool_calls is not none %}
{{- "[TOOL_CALLS] [" }}{%- for tool_call in message.tool_calls %}
{%- set out = tool_call.function|tojson %}{{- out[:-1] }}
{{- ', "id": "' + tool_call.id + '"}' }}
{%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
{%- endfor %}{%- endif %}{%- endfor %}"""

MISTRAL_ARGS_LIKE = """{%- for message in messages %}{%- if message.role == 'assistant' %}
{{- message['content'] }}{%- for tool in message['tool_calls'] %}
{%- set arguments = tool['function']['arguments'] %}
{%- if arguments is not string %}{%- set arguments = arguments|tojson|safe %}{%- endif %}
{{- '[TOOL_CALLS]' + tool['function']['name'] + '[ARGS]' + arguments }}
{%- endfor %}{{- eos_token }}{%- endif %}{%- endfor %}"""

GPT_OSS_LIKE = """{%- for message in messages %}{%- if message.tool_calls %}
{%- set tool_call = message.tool_calls[0] %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- "<|start|>assistant to=" }}
{{- "functions." + tool_call.name + "<|channel|>commentary " }}
{{- (tool_call.content_type if tool_call.content_type is defined else "json") + "<|message|>" }}
{{- tool_call.arguments|tojson }}{{- "<|call|>" }}
{%- else %}{{- "<|start|>" + message.role + "<|message|>" + message.content + "<|end|>" }}
{%- endif %}{%- endfor %}"""

# Granite 3.1 to 3.3: the system prompt names the token; an assistant renders its content.
GRANITE_LIKE = """{%- set system_message = "You are Granite." %}
{%- if tools %}{%- set system_message = system_message + " When a tool is \
required to answer the user's query, respond only with <|tool_call|> followed by a JSON list \
of tools used." %}{%- endif %}
{{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\\n' }}
{%- if tools %}{{- '<|start_of_role|>available_tools<|end_of_role|>' + tools | tojson }}
{{- '<|end_of_text|>\\n' }}{%- endif %}
{%- for message in messages %}
{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] }}
{{- '<|end_of_text|>\\n' }}{%- endfor %}"""

GRANITE30_LIKE = """{%- for message in messages %}{%- if message['role'] == 'assistant_tool_call' %}
{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' + message['content'] }}
{{- '<|end_of_text|>\\n' }}{%- endif %}{%- endfor %}"""

# Granite 4 writes hermes blocks inside its Granite roles.
GRANITE4_LIKE = """{%- for message in messages %}{%- if message.role == 'assistant' %}
{{- '<|start_of_role|>' + message.role + '<|end_of_role|>' + message.content }}
{%- for tool_call in message.tool_calls %}
{%- if (loop.first and message.content) or (not loop.first) %}{{- '\\n' }}{%- endif %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}
{{- '<|end_of_text|>\\n' }}{%- endif %}{%- endfor %}"""

# A Phi-4-mini template that writes calls with its two tokens (the official one does not).
PHI4_MINI_CALLS_LIKE = """{%- for message in messages %}
{{- '<|' + message['role'] + '|>' + message['content'] }}
{%- if message.tool_calls %}{{- '<|tool_call|>' + message.tool_calls | map(attribute='function')
| list | tojson + '<|/tool_call|>' }}{%- endif %}{{- '<|end|>' }}{%- endfor %}"""

OLMO3_LIKE = """{%- for message in messages -%}{%- if message['role'] == 'system' -%}
{{- '<|im_start|>system\\n' + message['content'] -}}{%- if tools is not none -%}
{{- '<functions>' -}}{{- tools | tojson -}}{{- '</functions>' -}}{%- endif -%}
{{- '<|im_end|>\\n' -}}{%- elif message['role'] == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}
{%- if message.get('content', none) is not none -%}{{- message['content'] -}}{%- endif -%}
{%- if message.get('tool_calls', none) is not none -%}{{- '<function_calls>' -}}
{%- for tool_call in message['tool_calls'] -%}{%- set args = tool_call['function']['arguments'] -%}
{%- set ns = namespace(arguments_list=[]) -%}{%- for key, value in args.items() -%}
{%- set ns.arguments_list = ns.arguments_list + [key ~ '=' ~ (value | tojson)] -%}{%- endfor -%}
{%- set arguments = ns.arguments_list | join(', ') -%}
{{- tool_call['function']['name'] + '(' + arguments + ')' -}}
{%- if not loop.last -%}{{ '\\n' }}{%- endif -%}{%- endfor -%}
{{- '</function_calls>' -}}{%- endif -%}
{{- '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"""

WEATHER = ParsedCall("get_weather", {"city": "Paris", "units": "celsius"})
SEARCH = ParsedCall("search", {"query": "café ünï", "filters": {"year": [2023, 2024]}})
NO_ARGS = ParsedCall("now", {})

ALL_SYNTAXES: list[ToolCallSyntax] = [
    HermesSyntax(), HermesSyntax(compact=True), Llama3JsonSyntax(), MistralSyntax(),
    MistralSyntax(args_form=True), GptOssSyntax(), GraniteSyntax(), Phi4MiniSyntax(),
    Olmo3Syntax(),
]


def _render(template: str, messages: list[dict[str, Any]]) -> str:
    return render_in_process(template, messages, False, None, CLOCK_A, {"eos_token": "</s>"})


def _assistant(content: str, calls: list[ParsedCall]) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call{i:05d}", "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]}


@pytest.mark.parametrize(("template", "expected"), [
    (QWEN_LIKE, HermesSyntax()),
    (LLAMA31_LIKE, Llama3JsonSyntax()),
    (MISTRAL_V03_LIKE, MistralSyntax()),
    (MISTRAL_ARGS_LIKE, MistralSyntax(args_form=True)),
    (GPT_OSS_LIKE, GptOssSyntax()),
    (builtin_chat_template(), HermesSyntax(compact=True)),
    (GRANITE_LIKE, GraniteSyntax()),
    (GRANITE30_LIKE, GraniteSyntax()),
    (GRANITE4_LIKE, HermesSyntax()),
    (PHI4_MINI_CALLS_LIKE, Phi4MiniSyntax()),
    (OLMO3_LIKE, Olmo3Syntax()),
])
def test_detects_each_family_from_its_markers(template: str, expected: ToolCallSyntax) -> None:
    assert syntax_for_template(template) == expected


def test_detection_names() -> None:
    names = [type(s).name for s in ALL_SYNTAXES]
    assert names == ["hermes", "hermes", "llama3_json", "mistral", "mistral", "gpt_oss",
                     "granite", "phi4_mini_json", "olmo3"]


def test_builtin_format_is_hermes_in_format_tool_calls_form() -> None:
    syntax = syntax_for_template(None, builtin=True)
    assert syntax == HermesSyntax(compact=True) and syntax is not None
    assert syntax.name == "hermes"
    assert syntax.format("", [WEATHER]) == format_tool_call(WEATHER.name, WEATHER.arguments)


@pytest.mark.parametrize("template", [
    None, "",
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content }}{% endfor %}",
    "{{ '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}",  # Llama 3.0
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>' }}",  # Gemma
    "{{ '<|user|>\\n' + message['content'] + '\\n' }}{{ '<|assistant|>\\n' }}",  # OLMo 2
    "{{ '<|user|>\\n' + message['content'] + '<|end|>\\n<|assistant|>\\n' }}",  # Phi-3, 3.5
    "{{ '<|im_start|>user<|im_sep|>' + message['content'] + '<|im_end|>' }}",  # Phi-4 (14B)
    # Phi-4-mini's official template: tools as a system message's string, no calls.
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools']"
    " + '<|/tool|>' + '<|end|>' }}",
    "{{ '<|assistant|>' + message['content'] + '<|tool_call|>' }}",  # neither Granite nor Phi
    "{{ '<|im_start|>assistant\\n<tool_call>\\n<function=' + name + '>' }}",  # Qwen3-Coder XML
    "{{ '<tool_call>' + name + '<arg_key>' + key + '</arg_key>' }}",  # GLM-4.5 XML
])
def test_unknown_templates_have_no_syntax(template: str | None) -> None:
    assert syntax_for_template(template) is None


@pytest.mark.parametrize("syntax", [HermesSyntax(), HermesSyntax(compact=True)])
def test_hermes_parses_blocks_with_and_without_whitespace(syntax: HermesSyntax) -> None:
    spaced = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": ' \
             '{"city": "Paris", "units": "celsius"}}\n</tool_call>'
    tight = '<tool_call>{"name":"search","arguments":{"query":"café ünï",' \
            '"filters":{"year":[2023,2024]}}}</tool_call>'
    assert syntax.parse(spaced) == ("Checking.", [WEATHER])
    assert syntax.parse(tight) == ("", [SEARCH])
    assert syntax.parse(spaced + "\n" + tight + "\nDone.") == ("Checking.\n\n\nDone.",
                                                                [WEATHER, SEARCH])
    assert syntax.parse('<tool_call>{"name": "now"}</tool_call>') == ("", [NO_ARGS])


def test_hermes_leaves_unusable_blocks_in_the_content() -> None:
    syntax = HermesSyntax()
    good = format_tool_call(WEATHER.name, WEATHER.arguments)
    for bad in ['<tool_call>{"name": "f", "arguments": {</tool_call>',
                '<tool_call>{"arguments": {}}</tool_call>',
                '<tool_call>{"name": 3}</tool_call>',
                '<tool_call>{"name": "f", "arguments": [1]}</tool_call>']:
        assert syntax.parse(bad) == (bad, [])
        assert syntax.parse(f"{bad} {good}") == (bad, [WEATHER])
    unclosed = good + ' then <tool_call>{"name": "f"'
    assert syntax.parse(unclosed) == ('then <tool_call>{"name": "f"', [WEATHER])
    assert syntax.parse("  no calls here ") == ("  no calls here ", [])


def test_hermes_close_tag_inside_a_json_string_does_not_end_the_block() -> None:
    call = ParsedCall("echo", {"text": "</tool_call> is a tag"})
    assert HermesSyntax().parse(HermesSyntax().format("", [call])) == ("", [call])


def test_llama3_parses_bare_tagged_and_parallel_calls() -> None:
    syntax = Llama3JsonSyntax()
    one = '{"name": "get_weather", "parameters": {"city": "Paris", "units": "celsius"}}'
    assert syntax.parse(one) == ("", [WEATHER])
    assert syntax.parse("  <|python_tag|>" + one) == ("", [WEATHER])
    assert syntax.parse(one + '; {"name": "now", "arguments": {}}') == ("", [WEATHER, NO_ARGS])
    assert syntax.parse("Sure.<|python_tag|>" + one + "\nsent") == ("Sure.\nsent", [WEATHER])


def test_llama3_reads_nothing_unless_every_object_is_a_call() -> None:
    syntax = Llama3JsonSyntax()
    call = '{"name": "now", "parameters": {}}'
    for text in ['{"answer": 4}', '{"name": "now", "parameters": {', "The answer is 4.",
                 'I would call {"name": "now", "parameters": {}}', f'{call}; {{"x": 1}}',
                 '{"name": "now", "parameters": "not an object"}']:
        assert syntax.parse(text) == (text, [])


def test_mistral_parses_array_and_args_forms() -> None:
    array = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "units": '
             '"celsius"}, "id": "abcdef123"}, {"name": "now", "arguments": {}}]')
    named = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "units": "celsius"}' \
            '[TOOL_CALLS]now[CALL_ID]abc123def[ARGS]{}'
    for syntax in (MistralSyntax(), MistralSyntax(args_form=True)):
        assert syntax.parse(array) == ("", [WEATHER, NO_ARGS])
        assert syntax.parse("Let me look." + named) == ("Let me look.", [WEATHER, NO_ARGS])


def test_mistral_leaves_malformed_calls_in_the_content() -> None:
    syntax = MistralSyntax()
    for bad in ['[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"arguments": {}}]',
                '[TOOL_CALLS] [{"name": "f", "arguments": {',
                "[TOOL_CALLS] []",
                "[TOOL_CALLS]f[ARGS]not json"]:
        assert syntax.parse(bad) == (bad, [])


def test_gpt_oss_parses_both_header_orders_and_keeps_other_messages() -> None:
    syntax = GptOssSyntax()
    sampled = ('<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant'
               '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
               '{"city":"Paris","units":"celsius"}<|call|>')
    assert syntax.parse(sampled) == ("<|channel|>analysis<|message|>Need weather.<|end|>",
                                     [WEATHER])
    role_form = ' to=functions.now<|channel|>commentary json<|message|>{}<|call|>'
    assert syntax.parse(role_form) == ("", [NO_ARGS])
    bad = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops<|call|>"
    assert syntax.parse(bad) == (bad, [])
    final = "<|channel|>final<|message|>It is sunny.<|return|>"
    assert syntax.parse(final) == (final, [])


@pytest.mark.parametrize("syntax", [GraniteSyntax(), Phi4MiniSyntax()], ids=repr)
def test_granite_and_phi4_mini_parse_call_arrays(syntax: GraniteSyntax) -> None:
    array = ('[{"name": "get_weather", "arguments": {"city": "Paris", "units": "celsius"}}, '
             '{"name": "now", "parameters": {}}]')
    assert syntax.parse("<|tool_call|>" + array) == ("", [WEATHER, NO_ARGS])
    assert syntax.parse(f"<|tool_call|>\n{array}\nsent") == ("sent", [WEATHER, NO_ARGS])
    assert syntax.parse('Sure.<|tool_call|>{"name": "now"}') == ("Sure.", [NO_ARGS])
    # Phi-4-mini's end token is its own (and need not be there: sampling may stop first).
    closed = f"<|tool_call|> {array} <|/tool_call|>"
    end = "" if isinstance(syntax, Phi4MiniSyntax) else "<|/tool_call|>"
    assert syntax.parse(closed) == (end, [WEATHER, NO_ARGS])


@pytest.mark.parametrize("syntax", [GraniteSyntax(), Phi4MiniSyntax()], ids=repr)
def test_granite_and_phi4_mini_leave_malformed_calls_in_the_content(syntax: GraniteSyntax) -> None:
    for bad in ['<|tool_call|>[{"name": "f", "arguments": {}}, {"arguments": {}}]',
                '<|tool_call|>[{"name": "f", "arguments": {',
                "<|tool_call|>[]<|/tool_call|>",
                '<|tool_call|>[{"name": "f", "arguments": "{}"}]',
                '<|tool_call|>"get_weather"',
                '[{"name": "f", "arguments": {}}]']:  # the token is what marks a call
        assert syntax.parse(bad) == (bad, [])


@pytest.mark.filterwarnings("ignore:invalid escape sequence")  # Python's, on the JSON `\\/`
def test_olmo3_parses_pythonic_lines_in_json_and_python_spellings() -> None:
    syntax = Olmo3Syntax()
    template_form = ('<function_calls>get_weather(city="Paris", units="celsius")\n'
                     'search(query="café ünï", filters={"year": [2023, 2024]})</function_calls>')
    assert syntax.parse("Let me look." + template_form) == ("Let me look.", [WEATHER, SEARCH])
    spaced = ("<function_calls>\n  get_weather(city='Paris', units='celsius')\n  now()\n"
              "</function_calls>\nsent")
    assert syntax.parse(spaced) == ("sent", [WEATHER, NO_ARGS])
    literals = ("<function_calls>f(a=true, b=null, c=False, d=None, e=-2, f=+1.5, "
                "g=[1, 'x'], h={'k': (1, 2)}, i='it\\'s', j=\"\\/\\u00e9\")</function_calls>")
    assert syntax.parse(literals) == ("", [ParsedCall("f", {
        "a": True, "b": None, "c": False, "d": None, "e": -2, "f": 1.5, "g": [1, "x"],
        "h": {"k": [1, 2]}, "i": "it's", "j": "/é"})])  # a JSON string reads as JSON
    two_blocks = "<function_calls>now()</function_calls> and <function_calls>now()</function_calls>"
    assert syntax.parse(two_blocks) == ("and", [NO_ARGS, NO_ARGS])
    assert syntax.parse("<function_calls>spotify.play(x=1)</function_calls>") == (
        "", [ParsedCall("spotify.play", {"x": 1})])


def test_olmo3_leaves_anything_but_keyword_calls_of_literals_in_the_content() -> None:
    syntax = Olmo3Syntax()
    for bad in ["<function_calls>f(1)</function_calls>",  # positional
                "<function_calls>f(**{'a': 1})</function_calls>",
                "<function_calls>f(a=g())</function_calls>",  # never evaluated
                "<function_calls>f(a=x)</function_calls>",
                "<function_calls>f(a=~1)</function_calls>",
                "<function_calls>f(a={1: 2})</function_calls>",
                "<function_calls>import os</function_calls>",
                "<function_calls>now()\nx = 1</function_calls>",
                "<function_calls>get-weather(city='Paris')</function_calls>",
                "<function_calls>f(from='Paris')</function_calls>",  # a Python keyword
                "<function_calls>f(a=1</function_calls>",
                "<function_calls></function_calls>",
                "<function_calls>now()"]:  # unclosed
        assert syntax.parse(bad) == (bad, [])
    good = "<function_calls>now()</function_calls>"
    assert syntax.parse(f"<function_calls>f(1)</function_calls> {good}") == (
        "<function_calls>f(1)</function_calls>", [NO_ARGS])


def test_olmo3_close_tag_inside_a_string_does_not_end_the_block() -> None:
    call = ParsedCall("echo", {"text": "</function_calls> is a tag"})
    assert Olmo3Syntax().parse(Olmo3Syntax().format("", [call])) == ("", [call])


@pytest.mark.parametrize("syntax", ALL_SYNTAXES, ids=repr)
@pytest.mark.parametrize("content", ["", "  Let me check that.\n", "Two lines.\nSecond one."])
@pytest.mark.parametrize("calls", [[], [WEATHER], [SEARCH, NO_ARGS, WEATHER]], ids=len)
def test_format_then_parse_round_trips(
    syntax: ToolCallSyntax, content: str, calls: list[ParsedCall]
) -> None:
    assert syntax.parse(syntax.format(content, calls)) == (content.strip(), calls)


@pytest.mark.parametrize("content", ["", "Let me check."])
def test_hermes_format_is_what_a_qwen_template_renders(content: str) -> None:
    rendered = _render(QWEN_LIKE, [_assistant(content, [WEATHER, SEARCH])])
    expected = HermesSyntax().format(content, [WEATHER, SEARCH])
    assert rendered == f"<|im_start|>assistant\n{expected}<|im_end|>\n"


def test_llama3_format_is_what_a_llama31_template_renders() -> None:
    rendered = _render(LLAMA31_LIKE, [_assistant("", [SEARCH])])
    expected = Llama3JsonSyntax().format("", [SEARCH])
    assert rendered == f"<|start_header_id|>assistant<|end_header_id|>\n\n{expected}<|eot_id|>"


@pytest.mark.parametrize("content", ["", "Let me check."])
def test_mistral_args_format_is_what_its_template_renders(content: str) -> None:
    rendered = _render(MISTRAL_ARGS_LIKE, [_assistant(content, [WEATHER, SEARCH])])
    assert rendered == MistralSyntax(args_form=True).format(content, [WEATHER, SEARCH]) + "</s>"


@pytest.mark.parametrize("content", ["", "Let me check."])
def test_olmo3_format_is_what_an_olmo3_template_renders(content: str) -> None:
    rendered = _render(OLMO3_LIKE, [_assistant(content, [WEATHER, SEARCH, NO_ARGS])])
    expected = Olmo3Syntax().format(content, [WEATHER, SEARCH, NO_ARGS])
    assert rendered == f"<|im_start|>assistant\n{expected}<|im_end|>\n"


@pytest.mark.parametrize("content", ["", "Let me check."])
def test_hermes_format_is_what_a_granite4_template_renders(content: str) -> None:
    rendered = _render(GRANITE4_LIKE, [_assistant(content, [WEATHER, SEARCH])])
    expected = HermesSyntax().format(content, [WEATHER, SEARCH])
    assert rendered == f"<|start_of_role|>assistant<|end_of_role|>{expected}<|end_of_text|>\n"


def test_phi4_mini_format_is_what_a_template_with_its_tokens_renders() -> None:
    rendered = _render(PHI4_MINI_CALLS_LIKE, [_assistant("", [WEATHER, SEARCH])])
    assert rendered == f"<|assistant|>{Phi4MiniSyntax().format('', [WEATHER, SEARCH])}<|end|>"


def test_granite_reads_what_granite_templates_render() -> None:
    # 3.1 to 3.3 render the call as the reply's text; 3.0 adds the token to the role.
    message = {"role": "assistant", "content": GraniteSyntax().format("", [WEATHER, SEARCH])}
    rendered = _render(GRANITE_LIKE, [message])
    reply = rendered.split("<|start_of_role|>assistant<|end_of_role|>")[1]
    assert GraniteSyntax().parse(reply.removesuffix("<|end_of_text|>\n")) == ("", [WEATHER, SEARCH])
    body = '[{"name": "now", "arguments": {}}]'
    rendered = _render(GRANITE30_LIKE, [{"role": "assistant_tool_call", "content": body}])
    assert GraniteSyntax().parse(rendered) == (
        "<|start_of_role|>assistant<|end_of_role|><|end_of_text|>", [NO_ARGS])


def test_mistral_v03_and_gpt_oss_template_renders_parse_back() -> None:
    mistral = _render(MISTRAL_V03_LIKE, [_assistant("", [WEATHER, SEARCH])])
    assert MistralSyntax().parse(mistral.removesuffix("</s>")) == ("", [WEATHER, SEARCH])
    gpt_oss = _render(GPT_OSS_LIKE, [_assistant("", [SEARCH])])
    assert gpt_oss.startswith("<|start|>assistant to=functions.search<|channel|>")
    assert GptOssSyntax().parse(gpt_oss) == ("", [SEARCH])


@pytest.mark.parametrize("syntax", ALL_SYNTAXES, ids=repr)
def test_parse_never_raises(syntax: ToolCallSyntax) -> None:
    deep = "[" * 5000 + "]" * 5000
    for text in ["", "<tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[TOOL_CALLS][" + deep,
                 "<tool_call>" + deep + "</tool_call>", "{" * 5000, "<|python_tag|>;;",
                 "<|channel|>commentary to=functions.<|message|>", "\x00\ud800",
                 "<|tool_call|>" + deep, "<|tool_call|>{" * 2000, "<|/tool_call|>",
                 "<function_calls>" + deep + "</function_calls>",
                 "<function_calls>f(a='\ud800')</function_calls>",
                 "<function_calls>\x00</function_calls>",
                 "<function_calls>f(a=" + "-" * 100_000 + "1)</function_calls>",
                 "<function_calls>x</function_calls>" * 500]:
        content, calls = syntax.parse(text)
        assert (content, calls) == (text, [])


@pytest.mark.parametrize("syntax", ALL_SYNTAXES, ids=repr)
@pytest.mark.parametrize("call", [WEATHER, SEARCH, NO_ARGS], ids=lambda c: c.name)
def test_a_forced_opening_starts_the_call_and_the_rest_parses_back(
        syntax: ToolCallSyntax, call: ParsedCall) -> None:
    """What a server forces for `tool_choice` (named: through the name and the start of
    the arguments; "required": up to the name) is how `format` begins the call, and the
    model's rest of the call, written after it, reads back as that call."""
    written = syntax.format("", [call])
    for name in (call.name, None):
        opening = syntax.forced_opening(name)
        assert opening is not None and written.startswith(opening)
        assert not opening.endswith(" ")  # the model's next token starts its own word
        assert syntax.parse(opening + written[len(opening):]) == ("", [call])
    named = syntax.forced_opening(call.name)
    assert named is not None and call.name in named


@pytest.mark.parametrize(("syntax", "name"), [
    (Olmo3Syntax(), "get-weather"), (Olmo3Syntax(), "class"),
    (MistralSyntax(args_form=True), "get weather"), (GptOssSyntax(), "get weather"),
])
def test_a_name_a_syntax_cannot_read_back_cannot_be_forced(syntax: ToolCallSyntax,
                                                           name: str) -> None:
    assert syntax.forced_opening(name) is None
    assert syntax.forced_opening(None) is not None
