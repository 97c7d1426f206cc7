"""The sampler wing: prefill and decode over a paged KV pool with a prefix cache.

`kv_pool.py` (the KV blocks), `block_manager.py` (free and referenced blocks),
`prefix_cache.py` (the prefix index over them, reservations, eviction), `requests.py`
(request state and limits), `scheduler.py` (prefill or decode batches, stops,
retirement), `batch.py` (a batch's rows and tables), `runner.py` (a batch through the
model), `token_sampler.py` (greedy, temperature, top-k, top-p), `threads.py` (thread
counts by timing), `engine.py` (the engine thread: schedule, run, postprocess) and
`sampling.py` (the `SamplingClient` users hold). It imports the model wing, never the
trainer's.
"""

from prefixgym.engine.sampler.engine import Engine
from prefixgym.engine.sampler.kv_pool import KVPool
from prefixgym.engine.sampler.prefix_cache import PrefixCache
from prefixgym.engine.sampler.requests import (
    DEFAULT_MAX_KV_BYTES,
    DEFAULT_MAX_RUNNING,
    RequestLimits,
)
from prefixgym.engine.sampler.sampling import SamplingClient

__all__ = ["DEFAULT_MAX_KV_BYTES", "DEFAULT_MAX_RUNNING", "Engine", "KVPool", "PrefixCache",
           "RequestLimits", "SamplingClient"]
