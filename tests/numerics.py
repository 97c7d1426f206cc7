"""The dtype a test's numbers are computed in, and how far two computations of the same
numbers may differ in it.

A test that compares numbers names its dtype instead of inheriting `--compute-dtype
auto` (which picks bf16 on a CPU with AVX512-BF16 or AMX and fp32 elsewhere, so that one
suite would test different things on different machines):

- exactness claims (cached == uncached, shared == plain, resume == uninterrupted) are
  about float32, where two computations differ by summation order only: the test's own
  fp32 tolerance;
- claims that hold in either dtype take the `numerics` fixture (tests/conftest.py):
  float32 by default, bfloat16 with `PREFIXGYM_TEST_DTYPE=bf16`, which runs the
  trainer as `auto` does on a bf16 CPU (torch runs bf16 matmuls on any CPU, slowly
  where it emulates them). Their bf16 bounds come from bf16's precision, below;
- `DTYPES` parametrizes the claims every CPU kind must check in both dtypes.

The bf16 bound. bf16 keeps 8 significant bits, so rounding a value to bf16 moves it by
at most u = 2^-8 of itself. Under autocast every matmul rounds its operands to bf16 and
accumulates in fp32, so a sum over a long sequence (attention over T keys, a weight's
gradient over T tokens) adds no error that grows with T: what grows is the number of
roundings a value passes through, one per matmul stage on its way, L blocks and the
head. First order, the logits then carry a relative error of at most (L + 1) u, so each
logit moves by at most (L + 1) u max|logit|, and a logprob, a logit minus the
log-sum-exp of all of them, by at most twice that:

    |logprob_a - logprob_b| <= 2 (L + 1) u max|logit|

Two computations that both run in bf16 but group their work differently (a shared
prefix, a chunk boundary, another rank) are each within that of the exact value, so
within twice it of each other. Measured on the tiny preset at init (L = 4, max|logit|
1.4-1.7; an Intel Xeon with AMX, 2026-12-03): bf16 trainer vs fp32 sampler 3.5e-3 to
5.3e-3 over sequences of 32 to 1024 tokens, against a bound of 0.066 at max|logit| 1.7;
after training to max|logit| ~ 15, 0.03-0.05 against 0.59. The sequence length does
not enter, as derived.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

BF16_UNIT_ROUNDOFF = 2.0**-8


@dataclass(frozen=True)
class Numerics:
    """A compute dtype for the trainer and the bounds that go with it."""

    name: str  # "float32" or "bfloat16": TrainConfig.compute_dtype and --compute-dtype

    def __str__(self) -> str:  # test ids: [float32], [bfloat16]
        return self.name

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.name == "bfloat16" else torch.float32

    @property
    def is_bf16(self) -> bool:
        return self.name == "bfloat16"

    def logprob_atol(self, fp32: float, n_layers: int, max_abs_logit: float,
                     sides: int = 1) -> float:
        """How far one logprob may move between two computations of it: `fp32` as the
        test states it for float32; in bf16 2 (L + 1) u max|logit| per side that rounds
        in bf16 (module docstring): sides=1 against an fp32 computation (a sampler),
        sides=2 between two bf16 ones that group their work differently."""
        if not self.is_bf16:
            return fp32
        return sides * 2 * (n_layers + 1) * BF16_UNIT_ROUNDOFF * max_abs_logit

    def rel(self, fp32: float, n_layers: int, sides: int = 2) -> float:
        """How far a loss or a gradient may move, relative to its largest entry, between
        two computations of it: `fp32` as the test states it; in bf16, per side that
        rounds in bf16, the relative error of a value that passed through the forward's
        L + 1 stages and the backward's L + 1 again: 2 (L + 1) u."""
        if not self.is_bf16:
            return fp32
        return sides * 2 * (n_layers + 1) * BF16_UNIT_ROUNDOFF


def max_abs_logit(model: torch.nn.Module, tokens: list[int]) -> float:
    """max|logit| of `model` (fp32) over the positions of `tokens`: the scale in the bounds."""
    with torch.no_grad():
        return float(model(torch.tensor([tokens])).abs().max())


TINY_LAYERS = 4
TINY_MAX_LOGIT = 2.0
"""The built-in tiny preset at init, or a few small steps from it: max|logit| 1.4-1.7
measured over sequences of 32-1024 tokens."""


def tiny_logprob_atol(numerics: Numerics, fp32: float) -> float:
    """`Numerics.logprob_atol` for the tiny preset near init: in bf16 2 x 5 x 2^-8 x 2 =
    0.078, against 3.5e-3 to 5.3e-3 measured between a bf16 trainer and an fp32 sampler."""
    return numerics.logprob_atol(fp32, TINY_LAYERS, TINY_MAX_LOGIT)


FP32 = Numerics("float32")
BF16 = Numerics("bfloat16")
DTYPES = [FP32, BF16]
TEST_DTYPE_VARIABLE = "PREFIXGYM_TEST_DTYPE"
_NAMES = {"fp32": FP32, "float32": FP32, "bf16": BF16, "bfloat16": BF16}


def from_environment() -> Numerics:
    """The test dtype: PREFIXGYM_TEST_DTYPE (fp32, the default, or bf16)."""
    asked = os.environ.get(TEST_DTYPE_VARIABLE, "fp32")
    if asked not in _NAMES:
        raise ValueError(f"{TEST_DTYPE_VARIABLE}={asked!r}: use fp32 or bf16")
    return _NAMES[asked]
