"""`--chat-template FILE` on `train` and `serve`: a chat template read from a file in
place of the model's own, and the one line a model without any gets.

A base model's GGUF file often carries no template (Gemma 3 270M's does not), and a
chat needs one. The file is what `prefixgym lint template PATH` reads: a .jinja file,
a tokenizer_config.json or a model directory. Knows that reader; nothing of runs,
servers or tokenizers.
"""

from __future__ import annotations

from prefixgym.prompting.lint.source import load_template

__all__ = ["missing_template_line", "read_template_file"]


def read_template_file(path: str) -> str | None:
    """The chat template at `path` (None when `path` is empty); ValueError naming the
    flag and the file when it cannot be read."""
    if not path:
        return None
    try:
        return load_template(path).template
    except ValueError as e:  # LintInputError: the file, and what is wrong with it
        raise ValueError(f"--chat-template {e}") from None


def missing_template_line(model: str) -> str:
    """What a model without a chat template is told: how to give it one."""
    return (f"--model {model} has no chat template (a base model's GGUF file often has "
            "none): give one with --chat-template FILE (a .jinja file, a "
            "tokenizer_config.json or a model directory)")
