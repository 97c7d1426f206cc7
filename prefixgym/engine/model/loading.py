"""A model by name: a built-in preset (random init, seeded), a local Hugging Face
checkpoint directory or a `.gguf` file (read through its converted directory:
`gguf_import.py`). The one place that decides which a name is; knows the presets
(`config.py`), the decoder and the checkpoint readers, nothing of serving or training."""

from __future__ import annotations

import dataclasses
import os

import torch

from prefixgym.engine.model.config import PRESETS
from prefixgym.engine.model.decoder import Transformer, init_weights
from prefixgym.engine.model.gguf_import import checkpoint_dir_of, is_gguf_path
from prefixgym.engine.model.hf_checkpoint import load_hf_checkpoint

__all__ = ["load_model"]


def load_model(
    name_or_dir: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    *,
    max_seq_len: int | None = None,
) -> Transformer:
    """A preset name ("tiny", "small") → a seeded random model; a local HF checkpoint
    directory (config.json + *.safetensors) or a .gguf file → that checkpoint. Returned in
    train mode."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    name = os.fspath(name_or_dir)
    if name in PRESETS:
        config = PRESETS[name]
        if max_seq_len is not None:
            config = dataclasses.replace(config, max_seq_len=max_seq_len)
        with torch.device("meta"):  # skip nn.Linear's init, which draws from the global RNG
            model = Transformer(config)
        model.to_empty(device="cpu")
        init_weights(model, seed)
        model.to(dtype)
        model.build_rope_tables(torch.device("cpu"))
        return model
    if os.path.isdir(name):
        return load_hf_checkpoint(name, dtype=dtype, max_seq_len=max_seq_len)
    if is_gguf_path(name):
        return load_hf_checkpoint(checkpoint_dir_of(name), dtype=dtype, max_seq_len=max_seq_len)
    raise ValueError(
        f"unknown model {name!r}: not a preset ({', '.join(sorted(PRESETS))}), "
        "a local directory or a .gguf file"
    )
