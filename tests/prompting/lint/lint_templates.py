"""Small chat templates written for the linter's tests, one per kind of break."""

from __future__ import annotations

_TOOL_CALLS = (
    "{%- if m.tool_calls %}{%- for tc in m.tool_calls %}"
    "{{- '<tool_call>' + (tc.function | tojson) + '</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
)

# Append-only ChatML: every prompt extends the previous prompt + reply + <|im_end|>.
CHATML = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content }}" + _TOOL_CALLS + "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3-like: the <think> block of earlier assistant turns is dropped.
STRIPS_THINK = (
    "{%- for m in messages %}"
    "{%- set c = m.content %}"
    "{%- if m.role == 'assistant' and not loop.last and '</think>' in c %}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + c }}" + _TOOL_CALLS + "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The system prompt is folded into the last user message.
SYSTEM_IN_LAST_USER = (
    "{%- set ns = namespace(sys='', last=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'system' %}{%- set ns.sys = m.content %}"
    "{%- elif m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role != 'system' %}"
    "{%- set c = m.content %}"
    "{%- if loop.index0 == ns.last and ns.sys %}{%- set c = ns.sys + '\\n\\n' + c %}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + c }}" + _TOOL_CALLS + "{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The last assistant turn ends with <|return|> (the model's stop token); in history, <|end|>.
END_OF_TURN_CHANGES = (
    "{%- for m in messages %}"
    "{{- '<|start|>' + m.role + '\\n' + m.content }}" + _TOOL_CALLS +
    "{%- if m.role == 'assistant' and loop.last %}{{- '<|return|>' }}{%- else %}{{- '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant\\n' }}{%- endif %}"
)

# A rendered history (no generation prompt) ends with EOS, which later renders drop.
EOS_IN_HISTORY = CHATML.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- else %}{{- eos_token }}{%- endif %}",
)

# History turns are separated by a blank line, the generation prompt by one newline.
WHITESPACE_CHANGES = (
    "{%- for m in messages %}{%- if not loop.first %}{{- '\\n\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content }}" + _TOOL_CALLS + "{{- '<|im_end|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '\\n<|im_start|>assistant\\n' }}{%- endif %}"
)

# Refuses the system role, as some Gemma/Mistral templates do.
REFUSES_SYSTEM = (
    "{%- if messages[0].role == 'system' %}{{- raise_exception('System role not supported') }}"
    "{%- endif %}" + CHATML
)

# Prints today's date in the system block.
READS_DATE = "{{- '<|im_start|>system\\nToday is ' + strftime_now('%d %b %Y') + '<|im_end|>\\n' }}" + CHATML

# SentencePiece style: '[INST] q [/INST]', the reply follows after one space.
SENTENCEPIECE_SPACE = (
    "{{- bos_token }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- ' ' + m.content }}" + _TOOL_CALLS + "{{- eos_token }}"
    "{%- else %}{{- '[INST] ' + (m.role + ': ' if m.role != 'user' else '') + m.content + ' [/INST]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)

# -- templates for the probes that sample like models -------------------------------------


def _chatml_with(assistant: str, generation: str = "") -> str:
    """ChatML where an assistant turn renders as the Jinja expression `assistant` (over `c`,
    the content) and the generation prompt adds `generation` (a Jinja statement block)."""
    return (
        "{%- for m in messages %}{%- set c = m.content %}"
        "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + " + assistant + " }}"
        "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + c }}{%- endif %}"
        + _TOOL_CALLS + "{{- '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}" + generation + "{%- endif %}"
    )


# DeepSeek-R1-like: every assistant turn, the one just sampled too, keeps only what follows
# '</think>'. The old probes read the reply off the history and missed it.
DROPS_REASONING = _chatml_with("(c.split('</think>')[-1] if '</think>' in c else c)")

# A thinking switch opens '<think>' in the generation prompt, while the history renders an
# assistant turn as '</think>' + answer (without the switch: reasoning dropped, PG101).
def thinking_switch_drops_opener(switch: str) -> str:
    return _chatml_with("('</think>' + c.split('</think>')[-1] if '</think>' in c else c)",
                        "{%- if " + switch + " %}{{- '<think>\\n' }}{%- endif %}")


SWITCH_DROPS_OPENER = thinking_switch_drops_opener("enable_thinking")

# The same switch, but the history keeps the block the prompt opened: append-only.
SWITCH_KEEPS_REASONING = _chatml_with(
    "('<think>\\n' + c.split('</think>')[0].split('<think>')[-1].strip('\\n') + '\\n</think>\\n\\n'"
    " + c.split('</think>')[-1].lstrip('\\n') if '</think>' in c else c)",
    "{%- if enable_thinking %}{{- '<think>\\n' }}{%- endif %}",
)

# Llama-2-like: ' ' + content.strip() + ' ' + EOS, so a reply that ends on EOS without the
# space, or with whitespace around it, is not what the history renders.
STRIPS_REPLY = (
    "{{- bos_token }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- ' ' + m.content.strip() + ' ' + eos_token }}"
    "{%- else %}{{- '[INST] ' + m.content.strip() + ' [/INST]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)

# Llama-3/Gemma-like: the reply is trimmed; breaks only for replies with whitespace around.
TRIMS_REPLY = _chatml_with("(c | trim)")

# Drops a <reasoning> block (not <think>): only a probe that reads the marker finds it.
DROPS_REASONING_TAG = _chatml_with("(c.split('</reasoning>')[-1] if '</reasoning>' in c else c)")

# Lists the tools in the last user message: breaks only when tools are passed.
TOOLS_IN_LAST_USER = (
    "{%- set ns = namespace(last=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}{%- set c = m.content %}"
    "{%- if tools and loop.index0 == ns.last %}"
    "{%- set c = c + '\\n\\nTools: ' + (tools | map(attribute='function') | map(attribute='name')"
    " | join(', ')) %}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + c }}" + _TOOL_CALLS + "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Question-answer style, as single-turn VQA templates write it: 'Question: q Answer: a ',
# the reply followed by a space and no end-of-turn token, so the EOS the model stopped
# on is not in the next prompt.
QA_WITHOUT_END_OF_TURN = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- 'Answer: ' + m.content + ' ' }}"
    "{%- elif m.role == 'system' %}{{- m.content + ' ' }}"
    "{%- else %}{{- 'Question: ' + m.content + ' ' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'Answer:' }}{%- endif %}"
)
