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
import torch.nn.functional as F
from decode_floor import FloorProbe, least_seconds_per_pass

from prefixgym.engine.model import Transformer

__all__ = ["StepFloor", "grpo_step_floor"]


@dataclass(frozen=True)
class StepFloor:
    generation_s: float
    update_s: float
    generation_ops_s: float = 0.0
    """The eager bound's other part of the generation (`decode_floor.py`, part 3)."""
    update_ops_s: float = 0.0
    """The eager bound's other part of the update (`update_ops_seconds`)."""
    sequence_generation_s: float = 0.0
    """The generation with its decode steps as `decode_floor.py`'s part 4 runs them
    (the kernels in sequence, from Python) and its prefill as matmuls: not a bound."""

    @property
    def seconds(self) -> float:
        return self.generation_s + self.update_s

    @property
    def eager_generation_s(self) -> float:
        return self.generation_s + self.generation_ops_s

    @property
    def eager_update_s(self) -> float:
        return self.update_s + self.update_ops_s


def grpo_step_floor(model: Transformer, rows: int, decoded_rows: int, prefill_rows: int,
                    train_rows: int, counts: list[int], passes: int = 8,
                    repeats: int = 3, keys: int | None = None, loss_rows: int = 0) -> StepFloor:
    """The matmul floor of a step that decoded `decoded_rows` tokens in steps of `rows`
    rows, prefilled `prefill_rows` positions and trained on `train_rows` positions; each
    part the least of `repeats` measurements (the machine's load only adds time). With
    `keys` (the decode steps' average context), also the eager bound's other ops: the
    decode steps' (`FloorProbe.ops_seconds`) and the update's over `loss_rows` loss
    positions (`update_ops_seconds`); and the decode steps' kernels in sequence
    (`FloorProbe.sequence_seconds`, from Python)."""
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
    if keys is None:
        return StepFloor(generation, update_s)
    decode_ops = min(probe.ops_seconds(rows, keys, passes)[0] for _ in range(repeats))
    update_ops = min(update_ops_seconds(model, train_rows, loss_rows, counts)
                     for _ in range(repeats))
    sequence = min(probe.sequence_seconds(rows, keys, passes, traced=False)[0]
                   for _ in range(repeats))
    return StepFloor(generation, update_s, decode_ops * decoded_rows / rows, update_ops,
                     generation + (sequence - per_step) * decoded_rows / rows)


def update_ops_seconds(model: Transformer, train_rows: int, loss_rows: int,
                       counts: list[int]) -> float:
    """Seconds of the update's work other than its matmuls, each op in its cheapest torch
    CPU kernel, forward and backward, at `train_rows` computed positions: per layer two
    `F.rms_norm`s, RoPE as one complex multiply, SiLU(gate) * up; the final norm;
    `logsumexp` over the vocabulary on `loss_rows` rows (the loss's normaliser); then one
    fused AdamW step over a copy of the model's parameters. Left out, so that it stays
    a lower bound: attention (its cost depends on the trie), residual adds, the
    embedding's gradient, the loss's own arithmetic, Python."""
    cfg, M = model.config, train_rows
    H, Hkv, D, C = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim
    gen = torch.Generator().manual_seed(M)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).requires_grad_()

    layers = [(leaf(M, C), leaf(C), leaf(M, C), leaf(C),
               torch.view_as_complex(leaf(M, H + Hkv, D // 2, 2)), leaf(M, cfg.hidden_dim),
               leaf(M, cfg.hidden_dim)) for _ in range(cfg.n_layers)]
    final, final_w, logits = leaf(M, C), leaf(C), leaf(max(loss_rows, 1), cfg.vocab_size)
    freqs = torch.view_as_complex(torch.randn(M, 1, D // 2, 2, generator=gen))
    leaves = [t for layer in layers for t in layer] + [final, final_w, logits]

    def forward() -> list[torch.Tensor]:
        outs = []
        for x1, w1, x2, w2, qk, gate, up in layers:
            outs += [F.rms_norm(x1, (C,), w1, cfg.norm_eps), torch.view_as_real(qk * freqs),
                     F.rms_norm(x2, (C,), w2, cfg.norm_eps), F.silu(gate) * up]
        return outs + [F.rms_norm(final, (C,), final_w, cfg.norm_eps),
                       torch.logsumexp(logits, -1)]

    with torch.no_grad():
        out_grads = [torch.ones_like(o) for o in forward()]

    def forward_backward() -> None:
        torch.autograd.backward(forward(), out_grads)
        for t in leaves:
            t.grad = None

    params = [p.detach().clone() for p in model.parameters()]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    adamw = torch.optim.AdamW(params, lr=1e-6, fused=True)
    fb_s = least_seconds_per_pass(forward_backward, 1, counts, float("inf"), grad=True)[0]
    adam_s = least_seconds_per_pass(adamw.step, 1, counts, float("inf"))[0]
    return fb_s + adam_s
