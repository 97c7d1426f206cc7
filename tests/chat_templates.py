"""Chat templates the tests share, written here (no hub): `QWEN3_LIKE` behaves as the
reasoning models' templates do (Qwen3, QwQ, DeepSeek-R1 distills): ChatML whose earlier
assistant turns lose their `<think>` block once a later user message follows, and
whose generation prompt, with `enable_thinking` false, opens an empty think block."""

_QWEN3_GENERATION_PROMPT = (
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)
"""Qwen3's generation prompt: an empty think block when `enable_thinking` is false."""

QWEN3_LIKE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}"
    "{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    + _QWEN3_GENERATION_PROMPT
)

# Granite-3.1-like: append-only as it stands, but its `controls` switch, passed, is printed
# into the generation prompt (`<|start_of_role|>assistant {...}<|end_of_role|>`) and never
# into the history; with no system message it prints today's date in its own.
GRANITE_LIKE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set system_message = messages[0]['content'] -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system_message = 'Knowledge cutoff: April 2024. Today is ' + strftime_now('%B %d, %Y')"
    " + '. You are Granite.' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\\n' -}}"
    "{%- if tools -%}"
    "{{- '<|start_of_role|>tools<|end_of_role|>' + tools | tojson + '<|end_of_text|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in loop_messages -%}"
    "{{- '<|start_of_role|>' + m['role'] + '<|end_of_role|>' + m['content'] -}}"
    "{%- if m.tool_calls -%}"
    "{{- '<|tool_call|>' + m.tool_calls | map(attribute='function') | list | tojson -}}"
    "{%- endif -%}"
    "{{- '<|end_of_text|>\\n' -}}"
    "{%- if loop.last and add_generation_prompt -%}"
    "{{- '<|start_of_role|>assistant' -}}"
    "{%- if controls -%}{{- ' ' + controls | tojson -}}{%- endif -%}"
    "{{- '<|end_of_role|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# A vision-language model's template: every message's content is a list of typed parts
# ({"type": "text", "text": ...}, images); a plain string prints nothing.
LIST_CONTENT = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' -}}"
    "{%- for part in m['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' -%}{{- '<image>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if m.tool_calls -%}{%- for tc in m.tool_calls -%}"
    "{{- '<tool_call>' + (tc.function | tojson) + '</tool_call>' -}}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Qwen3's own shape, closer: an assistant turn after the last user message gets its think
# block back, rebuilt from the reasoning it held ('<think>\n' + reasoning + '\n</think>\n\n'
# + answer, an empty block when there was none); earlier turns keep only the answer. So
# the latest reply renders otherwise once a question follows it, even without reasoning.
QWEN3_LATEST_THINK = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}"
    "{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set answer = m['content'].split('</think>')[-1].lstrip('\\n') -%}"
    "{%- set thought = m['content'].split('</think>')[0].split('<think>')[-1].strip('\\n')"
    " if '</think>' in m['content'] else '' -%}"
    "{%- if loop.index0 > ns.last_user -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + thought + '\\n</think>\\n\\n' + answer -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + answer -}}{%- endif -%}"
    "{%- if m.tool_calls -%}{%- for tc in m.tool_calls -%}"
    "{{- '\\n<tool_call>' + (tc.function | tojson) + '</tool_call>' -}}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    + _QWEN3_GENERATION_PROMPT
)
