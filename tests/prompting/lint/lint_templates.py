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
