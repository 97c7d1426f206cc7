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
           "KV_CACHE_DTYPES", "SamplerOptions"]

DEFAULT_CACHE_BYTES = 256 * 2**20
DEFAULT_MAX_KV_BYTES = 4 * 2**30
DEFAULT_MAX_RUNNING = 256
KV_CACHE_DTYPES = ("auto", "float32")


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
    shared_prefix_attention: bool = True
    """In a decode step, attend the keys that several rows share (a GRPO group's prompt,
    a system prompt: the same cached blocks) once for all of them, and each row's own
    keys apart (`shared_keys.py`; CPU, models whose attention is plain softmax without
    windows). The same softmax summed in another order: float noise."""
    kv_cache_dtype: str = "auto"
    """What the KV pool stores keys and values in: "auto", the model's dtype (a bf16 or
    fp16 model's keys and values are values of that dtype, so they are stored exactly in
    half the bytes of fp32: the pool holds twice the positions), or "float32". Either
    way attention on the CPU runs in fp32 (kv_pool.py), so both give the same bits."""
    deterministic: bool = False
    """Run each `sample_many` round alone, so that rounds submitted in a fixed order give
    the same bits every run (`engine.py`); with a bf16/fp16 model on CPU, also keep one
    thread count (docs/architecture.md, "Determinism")."""

    def __post_init__(self) -> None:
        for name in ("block_size", "cache_bytes", "max_running", "max_kv_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
