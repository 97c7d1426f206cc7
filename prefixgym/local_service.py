"""LocalService: the built-in engine with its tokenizer, as users create it.

    service = LocalService(model="tiny", seed=0)     # or a local HF checkpoint directory
    service.tokenizer                                # a transformers tokenizer

The engine (`engine.service.EngineService`) speaks token ids only. This class adds
the text side: it picks the tokenizer (the checkpoint directory's own, or the
built-in one), tells the engine which ids end an assistant turn, and gives it a
`decode` for stop strings. Everything else -- clients, weights versions, the cache,
the usage ledger -- is the engine's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from prefixgym.engine.hf_checkpoint import read_hf_config
from prefixgym.engine.model import PRESETS, ModelConfig, Transformer
from prefixgym.engine.requests import DEFAULT_MAX_KV_BYTES, DEFAULT_MAX_RUNNING
from prefixgym.engine.service import EngineService
from prefixgym.prompting.tokenizer import end_of_turn_ids, resolve_tokenizer


class LocalService(EngineService):
    """The local engine and its tokenizer. `model`: a preset name, a local HF checkpoint
    directory, a `ModelConfig` (randomly initialised with `seed`) or a `Transformer`.

    `tokenizer`: None picks the checkpoint directory's tokenizer for a directory and
    the built-in one otherwise; a directory name or a tokenizer object also works.
    Other arguments are the engine's (`EngineService`): `prefix_cache=False` runs the
    same engine without cache reads or writes; `num_threads` sets torch's intra-op
    threads (process-wide) only when given; `thread_tuning` lets the engine pick each
    kind of step's thread count by timing it; `max_running` and `max_kv_bytes` bound
    what one request may ask for (its samples, its running KV); `deterministic` runs
    each `sample_many` round alone, so that rounds submitted in a fixed order give the
    same bits every run; `device` ("cpu", "cuda", "mps", ...) is where the models, the
    KV pool and every engine and training tensor live.
    """

    def __init__(
        self,
        model: str | ModelConfig | Transformer = "tiny",
        seed: int = 0,
        prefix_cache: bool = True,
        block_size: int = 16,
        cache_bytes: int = 256 * 2**20,
        dtype: str | torch.dtype = "float32",
        tokenizer: PreTrainedTokenizerBase | str | Path | None = None,
        num_threads: int | None = None,
        max_running: int = DEFAULT_MAX_RUNNING,
        thread_tuning: bool = True,
        max_kv_bytes: int = DEFAULT_MAX_KV_BYTES,
        deterministic: bool = False,
        device: str | torch.device = "cpu",
    ) -> None:
        # An unknown model name, or a broken config.json, is the engine's error to report,
        # not the tokenizer's (transformers reads config.json too, and words it worse).
        checkpoint_dir = None
        if isinstance(model, str) and model not in PRESETS and Path(model).is_dir():
            checkpoint_dir = model
            read_hf_config(checkpoint_dir)
        tok = resolve_tokenizer(tokenizer, checkpoint_dir)

        def decode(ids: list[int]) -> str:
            return str(tok.decode(ids, skip_special_tokens=False))

        super().__init__(
            model, seed=seed, prefix_cache=prefix_cache, block_size=block_size,
            cache_bytes=cache_bytes, dtype=dtype, end_of_turn_ids=end_of_turn_ids(tok),
            decode=decode, num_threads=num_threads, max_running=max_running,
            thread_tuning=thread_tuning, max_kv_bytes=max_kv_bytes,
            deterministic=deterministic, device=device,
        )
        self.tokenizer: PreTrainedTokenizerBase = tok
