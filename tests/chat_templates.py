"""Chat templates the tests share, written here (no hub): `QWEN3_LIKE` behaves as the
reasoning models' templates do (Qwen3, QwQ, DeepSeek-R1 distills): ChatML whose earlier
assistant turns lose their `<think>` block once a later user message follows, and
whose generation prompt, with `enable_thinking` false, opens an empty think block."""

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
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)
