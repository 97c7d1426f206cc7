"""A tiny random Qwen2 model with the built-in tokenizer, as a local Hugging Face
directory: what tests that need `--model DIR` build (no hub)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from prefixgym.prompting.tokenizer import ASSETS_DIR, load_tokenizer


def save_tiny_qwen2(directory: Path, chat_template: str | None = None) -> None:
    """The model and tokenizer in `directory` (`chat_template` replaces the built-in one)."""
    torch.manual_seed(0)
    tokenizer = load_tokenizer(ASSETS_DIR)  # a copy: the shared built-in one stays as is
    config = Qwen2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=len(tokenizer), tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
