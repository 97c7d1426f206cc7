"""LocalService: the built-in engine with its tokenizer, as users create it.

    service = LocalService(model="tiny", seed=0)     # or a local HF checkpoint directory,
                                                     # or a .gguf file
    service.tokenizer                                # a transformers tokenizer

The engine (`engine.service.EngineService`) speaks token ids only. This class adds
the text side: it picks the tokenizer (the checkpoint directory's own, a .gguf
file's, or the built-in one), tells the engine which ids end an assistant turn, and
gives it a `decode` for stop strings, and writes both as one Hugging Face directory
(`save_hf_dir`). Everything else -- clients, weights versions, the cache,
the usage ledger -- is the engine's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from prefixgym.engine.model import PRESETS, ModelConfig, Transformer
from prefixgym.engine.model.gguf_import import checkpoint_dir_of, is_gguf_path
from prefixgym.engine.model.hf_config import read_hf_config
from prefixgym.engine.sampler.options import SamplerOptions
from prefixgym.engine.service import EngineService
from prefixgym.prompting.tokenizer import end_of_turn_ids, resolve_tokenizer


class LocalService(EngineService):
    """The local engine and its tokenizer. `model`: a preset name, a local HF checkpoint
    directory, a `.gguf` file (converted once to a cached directory:
    `engine/model/gguf_import.py`), a `ModelConfig` (randomly initialised with `seed`) or
    a `Transformer`.

    `tokenizer`: None picks the checkpoint's tokenizer for a directory or a .gguf file
    and the built-in one otherwise; a directory name or a tokenizer object also works.
    Every other argument is the engine's (`EngineService`: `dtype`, `device`,
    `num_threads`), and the sampler's options (`SamplerOptions`) go as one object,
    `sampler=`, or as its fields: `LocalService("tiny", prefix_cache=False)` runs the
    same engine without cache reads or writes, `deterministic=True` runs each
    `sample_many` round alone so that rounds submitted in a fixed order give the same
    bits every run, `cache_bytes`, `block_size`, `max_running`, `max_kv_bytes` and
    `thread_tuning` as documented there.
    """

    def __init__(
        self,
        model: str | ModelConfig | Transformer = "tiny",
        seed: int = 0,
        *,
        tokenizer: PreTrainedTokenizerBase | str | Path | None = None,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "auto",
        num_threads: int | None = None,
        sampler: SamplerOptions | None = None,
        **sampler_fields: Any,
    ) -> None:
        # An unknown model name, or a broken config.json, is the engine's error to report,
        # not the tokenizer's (transformers reads config.json too, and words it worse).
        checkpoint_dir = None
        if isinstance(model, str) and model not in PRESETS and is_gguf_path(model):
            model = str(checkpoint_dir_of(model))  # converted once, then read as a directory
        if isinstance(model, str) and model not in PRESETS and Path(model).is_dir():
            checkpoint_dir = model
            read_hf_config(checkpoint_dir)
        tok = resolve_tokenizer(tokenizer, checkpoint_dir)

        def decode(ids: list[int]) -> str:
            return str(tok.decode(ids, skip_special_tokens=False))

        super().__init__(model, seed, dtype=dtype, device=device, num_threads=num_threads,
                         end_of_turn_ids=end_of_turn_ids(tok, checkpoint_dir), decode=decode, sampler=sampler,
                         **sampler_fields)
        self.tokenizer: PreTrainedTokenizerBase = tok

    def save_hf_dir(self, directory: str | Path) -> Path:
        """The trainable model's weights and the tokenizer, as one Hugging Face model
        directory: what vLLM serves (`prefixgym serve --engine vllm`) and an adapter's
        base for other tools. Returns the directory."""
        from prefixgym.engine.model.hf_export import save_hf_checkpoint

        save_hf_checkpoint(self.train_model, directory)
        self.tokenizer.save_pretrained(str(directory))
        return Path(directory)
