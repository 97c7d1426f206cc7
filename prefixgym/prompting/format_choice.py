"""Which chat format a tokenizer's conversations use, chosen once per tokenizer.

`chat_format_for` picks, and keeps per tokenizer and template: the one a command set
with `use_chat_format`, else the built-in ChatML format for a tokenizer with
`<|im_start|>`/`<|im_end|>` and no template of its own (or the built-in one), else the
tokenizer's Jinja template through `HFTemplateFormat`. `make_chat_format` builds a new
one, with template switches; `mismatch_lines` says what a template used token by token
would have rendered otherwise. Knows tokenizers and chat formats; nothing of
conversations (`conversation.py`) or envs.
"""

from __future__ import annotations

import warnings
import weakref

from transformers import PreTrainedTokenizerBase

from prefixgym.prompting.chat_format import ChatFormat, ChatMLFormat, HFTemplateFormat
from prefixgym.prompting.tokenizer import builtin_chat_template
from prefixgym.types import JSONObject

_FORMATS: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, dict[str | None, ChatFormat]] = (
    weakref.WeakKeyDictionary()
)


def chat_format_for(
    tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None
) -> ChatFormat:
    """The format a Conversation uses for this tokenizer, built once per tokenizer+template.

    No template: the one `use_chat_format` set for the tokenizer; else the built-in
    ChatML format when the tokenizer has `<|im_start|>` and `<|im_end|>` and either no
    template or the built-in one; otherwise the tokenizer's own Jinja template through
    `HFTemplateFormat` (which raises TemplateNotAppendOnlyError for a template it cannot
    use turn by turn, and warns once for one it uses token by token although it would
    rewrite earlier replies: `HFTemplateFormat.template_mismatch`)."""
    per_tokenizer = _FORMATS.setdefault(tokenizer, {})
    if chat_template not in per_tokenizer:
        per_tokenizer[chat_template] = _make_format(tokenizer, chat_template)
    return per_tokenizer[chat_template]


def make_chat_format(
    tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None,
    template_kwargs: JSONObject | None = None,
) -> ChatFormat:
    """A new format for this tokenizer (see `chat_format_for`), with the template's
    switches (`template_kwargs`, e.g. {"enable_thinking": False}); not cached."""
    own = tokenizer.chat_template
    vocab = tokenizer.get_vocab()
    has_chatml = "<|im_start|>" in vocab and "<|im_end|>" in vocab
    if chat_template is None and has_chatml and (own is None or own == builtin_chat_template()):
        if template_kwargs:
            raise ValueError(f"template switches {sorted(template_kwargs)} given, but the "
                             "tokenizer uses the built-in ChatML format, which has none")
        return ChatMLFormat(tokenizer)
    if chat_template is None and own is None:
        raise ValueError(
            "tokenizer has no chat template and no <|im_start|>/<|im_end|> tokens; "
            "pass chat_template=... or chat_format=..."
        )
    return HFTemplateFormat(tokenizer, chat_template, template_kwargs=template_kwargs)


def _make_format(tokenizer: PreTrainedTokenizerBase, chat_template: str | None) -> ChatFormat:
    fmt = make_chat_format(tokenizer, chat_template)
    for line in mismatch_lines(fmt):
        warnings.warn(line, stacklevel=4)
    return fmt


def use_chat_format(tokenizer: PreTrainedTokenizerBase, chat_format: ChatFormat) -> None:
    """Make `chat_format` what every Conversation of `tokenizer` uses unless given one
    (a command does this once, e.g. with the template switches its flags name)."""
    _FORMATS.setdefault(tokenizer, {})[None] = chat_format


def mismatch_lines(fmt: ChatFormat) -> list[str]:
    """What a template used token by token would have rendered otherwise, one line per
    probe finding (none for an append-only template or the built-in format)."""
    findings = getattr(fmt, "template_mismatch", [])
    if not findings:
        return []
    return ["the chat template is not append-only: prompts are built turn by turn from "
            "the sampled tokens, so they differ from what apply_chat_template renders for "
            "the same conversation (a train/inference mismatch): "
            + "; ".join(f"{f.rule} {f.message}" for f in findings)]
