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
