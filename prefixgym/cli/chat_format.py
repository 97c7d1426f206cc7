"""A checkpoint's chat format for `train` and `rollout`, and the lines that say which it is.

A checkpoint directory or .gguf file renders conversations with its tokenizer's chat
template (or `--chat-template`'s, read by `chat_template.py`), at the switches of
`--chat-template-kwargs`; a built-in preset uses the built-in format and takes neither
flag. The lines returned say which format the run uses, the template's verdict at
those switches (as `lint template --template-kwargs` prints it) and what a template
that rewrites earlier replies would have rendered otherwise; the command prints them.
Knows the tokenizer it is given and the conversation builder; nothing of services,
runs or training.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from prefixgym.cli.chat_template import missing_template_line
from prefixgym.prompting.chat_format import ChatMLFormat
from prefixgym.prompting.conversation import make_chat_format, mismatch_lines, use_chat_format
from prefixgym.prompting.lint.report import switch_line, verdict_line
from prefixgym.trainer.config import is_pretrained_checkpoint
from prefixgym.types import JSONObject

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def checkpoint_chat_format(model: str, tokenizer: PreTrainedTokenizerBase,
                           template: str | None, template_flag: str,
                           kwargs: JSONObject | None) -> list[str]:
    """For a checkpoint `model`: `template` (`--chat-template FILE`'s text, None: the
    checkpoint's own) made `tokenizer`'s, and `use_model_chat_format`'s lines. A built-in
    model given `--chat-template` (`template_flag`) or switches, a checkpoint without a
    template, or a template that cannot be used even turn by turn: ValueError."""
    if not is_pretrained_checkpoint(model):
        if kwargs or template_flag:
            raise ValueError("--chat-template and --chat-template-kwargs apply to a "
                             f"checkpoint's chat template; --model {model} uses the "
                             "built-in format")
        return []
    if template is not None:
        tokenizer.chat_template = template
    try:
        return use_model_chat_format(model, tokenizer, kwargs)
    except ValueError:
        if not tokenizer.chat_template:
            raise ValueError(missing_template_line(model)) from None
        raise


def use_model_chat_format(model: str, tokenizer: PreTrainedTokenizerBase,
                          kwargs: JSONObject | None) -> list[str]:
    """Make the checkpoint's chat format, with the template switches `kwargs`, what every
    Conversation of `tokenizer` uses; the run's first lines about it: which format, the
    template's verdict at those switches and each other switch value that would break
    the prefix (the lines `lint template --template-kwargs` prints), and what a template
    rewriting earlier replies would have rendered otherwise. ValueError for a template
    that cannot be used even turn by turn."""
    kwargs = kwargs or {}
    try:
        fmt = make_chat_format(tokenizer, template_kwargs=kwargs)
    except ValueError as e:  # TemplateNotAppendOnlyError, or no template at all
        raise ValueError(f"--model {model}: its chat template cannot be used: {e}") from None
    use_chat_format(tokenizer, fmt)
    mismatch = mismatch_lines(fmt)
    kind = ("the built-in ChatML format" if isinstance(fmt, ChatMLFormat)
            else "its tokenizer's chat template, token by token" if mismatch
            else "its tokenizer's chat template")
    switches = f" with {json.dumps(kwargs, sort_keys=True)}" if kwargs else ""
    lines = [f"--model {model}: conversations use {kind}{switches}"]
    report = getattr(fmt, "template_report", None)
    if report is not None:
        lines.append(f"--model {model}: chat template: {verdict_line(report)}")
        lines += [f"--model {model}: chat template: {switch_line(f)}" for f in report.switches]
    lines += [f"--model {model}: warning: {line}" for line in mismatch]
    return lines
