"""prefixgym: agentic RL on your own machine, with a prefix-cached sampler.

Public names are imported lazily so that `import prefixgym` stays cheap and a part
of the package can be used without loading torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# Spin-waiting OpenMP threads make torch several times slower on a shared, busy CPU;
# this only takes effect when set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# MKL picks its matmul kernels by thread count (a 5-11-row matmul rounds differently on 1
# and 2 threads), and the engine's thread tuner picks counts by measured time, i.e. by
# load: in its default mode a run's sampler logprobs would depend on what else ran on the
# machine. Strict conditional numerical reproducibility makes MKL's results the same
# bits on any thread count, at no cost resolved above noise (docs/architecture.md,
# "Determinism").
# MKL reads it at its first call, so this must come before torch computes anything.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# torch keeps a compiled matmul per shape in two caches, ideep's and oneDNN's, 1,024 shapes
# each by default (~0.6 MB a bf16 shape in the two); every GRPO step brings new batch and
# wave sizes, so a run's memory crept ~20 MB a step (SmolLM2-135M, full and LoRA). At 64
# shapes each it stays flat and the steps take as long (docs/models.md, "Memory"). Both
# are read at their first use; a value the user set stands.
os.environ.setdefault("LRU_CACHE_CAPACITY", "64")
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")

from prefixgym.envs.registration import register_envs  # noqa: E402
from prefixgym.types import (  # noqa: E402
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    ModelInput,
    OptimStepOutput,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    Usage,
)

# `gym.make("prefixgym/<Name>-v0")` works after `import prefixgym` (the env modules are
# text only: no torch is loaded).
register_envs()

if TYPE_CHECKING:
    from prefixgym.local_service import LocalService

__all__ = [
    "AdamParams",
    "Datum",
    "ForwardBackwardOutput",
    "LocalService",
    "ModelInput",
    "OptimStepOutput",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "Usage",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LocalService":
        from prefixgym.local_service import LocalService

        return LocalService
    raise AttributeError(f"module 'prefixgym' has no attribute {name!r}")
