"""The matmul floor of one GRPO step: its linears at their shapes, timed on this machine.

A GRPO step of prefixgym does two kinds of model work:

- **generation**: the prefill forwards (one row per computed prompt position) and the
  decode steps (one row per sampled token after a sample's first, which its prefill
  gives), in steps of about `rows` rows;
- **update**: `forward_backward` over the train positions it computes, and per linear
  three matmuls: the forward (M, d_in) @ (d_in, d_out), the input gradient
  (M, d_out) @ (d_out, d_in) and the weight gradient (d_out, M) @ (M, d_in).

The floor is the time of exactly those matmuls (every `nn.Linear` of the model and the
output head, as `decode_floor.FloorProbe` lists them) at those shapes: decode steps of
`rows` rows timed over passes and scaled to the decoded rows, the prefill and the
update as one (M, ...) matmul each. Everything else a step does -- attention, norms,
RoPE, activations, the loss, sampling, the optimizer, the embedding's gradient (an
index-add, not a matmul), Python -- is left out, so no step reaches 1.0x; the ratio says
how far a step is from what its matmuls alone cost. The head's backward is counted over
every computed position, though the chunked head runs it on loss rows only: where
prompts dominate, the update floor is too high (in `bench_grpo_trl.py` all but ~40 of
~2,090 computed positions are in the loss).
Timed at `counts` threads, the least time counting (`least_seconds_per_pass`), and the
least of a few repeats: a lower floor makes "how close to it a step must come" more
lenient, so the bound errs on the generous side.

This module knows the model's linears and the step's token counts; not the engine,
the trainer or TRL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from decode_floor import FloorProbe, least_seconds_per_pass

from prefixgym.engine.model import Transformer

__all__ = ["StepFloor", "grpo_step_floor"]


@dataclass(frozen=True)
class StepFloor:
    generation_s: float
    update_s: float

    @property
    def seconds(self) -> float:
        return self.generation_s + self.update_s


def grpo_step_floor(model: Transformer, rows: int, decoded_rows: int, prefill_rows: int,
                    train_rows: int, counts: list[int], passes: int = 8,
                    repeats: int = 3) -> StepFloor:
    """The matmul floor of a step that decoded `decoded_rows` tokens in steps of `rows`
    rows, prefilled `prefill_rows` positions and trained on `train_rows` positions; each
    part the least of `repeats` measurements (the machine's load only adds time)."""
    probe = FloorProbe(model, torch.float32, counts, skip_fewer_above_s=float("inf"))
    per_step = min(probe.matmul_seconds(rows, passes)[0] for _ in range(repeats))
    generation = per_step * decoded_rows / rows
    if prefill_rows:
        generation += min(probe.matmul_seconds(prefill_rows, passes=1)[0]
                          for _ in range(repeats))
    gen = torch.Generator().manual_seed(train_rows)
    widths = {w.shape[0] for w, _ in probe.linears} | {w.shape[1] for w, _ in probe.linears}
    acts = {d: torch.randn(train_rows, d, generator=gen) for d in widths}

    def update() -> None:
        for weight_out_in, _ in probe.linears:
            d_out, d_in = weight_out_in.shape
            torch.mm(acts[d_in], weight_out_in.t())  # forward
            torch.mm(acts[d_out], weight_out_in)  # gradient of the input
            torch.mm(acts[d_out].t(), acts[d_in])  # gradient of the weight

    update_s = min(least_seconds_per_pass(update, 1, counts, float("inf"))[0]
                   for _ in range(repeats))
    return StepFloor(generation, update_s)
