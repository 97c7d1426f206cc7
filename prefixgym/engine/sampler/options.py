"""SamplerOptions: how the sampler wing is built -- its KV pool and prefix cache, what
one request may ask of it, its threads and whether its rounds run alone.

One object, made once (by a command from its flags, or by `LocalService(...,
prefix_cache=False)` from keywords) and handed down: the service builds the engine
from it. None of these changes what a request means; they change what is kept, how
much fits and how runs repeat. Knows nothing of models or requests beyond numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_CACHE_BYTES", "DEFAULT_MAX_KV_BYTES", "DEFAULT_MAX_RUNNING",
           "SamplerOptions"]

DEFAULT_CACHE_BYTES = 256 * 2**20
DEFAULT_MAX_KV_BYTES = 4 * 2**30
DEFAULT_MAX_RUNNING = 256


@dataclass(frozen=True)
class SamplerOptions:
    """The sampler's settings; see each field."""

    prefix_cache: bool = True
    """Keep finished sequences' KV blocks and serve matching prefixes from them; False runs
    the same engine without cache reads or writes."""
    block_size: int = 16
    """Positions per KV block: the granularity of cache hits."""
    cache_bytes: int = DEFAULT_CACHE_BYTES
    """The KV pool, preallocated on the service's device (pages are touched as blocks are
    first used): running sequences' KV and the cached blocks."""
    max_running: int = DEFAULT_MAX_RUNNING
    """Sequences decoding at once, and so the samples of one request at most."""
    max_kv_bytes: int = DEFAULT_MAX_KV_BYTES
    """Running KV one request may need: samples x (prompt + max_tokens) positions x the
    pool's bytes per position, as if no block were shared."""
    thread_tuning: bool = True
    """Run each kind of step on the thread count (up to torch's count at construction)
    measured fastest (`threads.py`); changes no fp32 bits."""
    pack_weights: bool = True
    """On the CPU, sample through oneDNN with each linear weight packed once into its
    kernels' layout (`model/packed.py`): 1.2-2.5x faster matmuls per decode step. A full
    publish's snapshot is packed in place; the weights the sampler shares with the
    trainer (version 0, a LoRA model's base) get one packed copy more. False samples
    through `F.linear` on the weights as they are."""
    deterministic: bool = False
    """Run each `sample_many` round alone, so that rounds submitted in a fixed order give
    the same bits every run (`engine.py`); with a bf16/fp16 model on CPU, also keep one
    thread count (docs/architecture.md, "Determinism")."""

    def __post_init__(self) -> None:
        for name in ("block_size", "cache_bytes", "max_running", "max_kv_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
