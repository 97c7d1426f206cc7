"""The floor of one decode step: the least time its matmuls and its memory reads can take;
and the eager bound: the floor's matmuls plus the other ops every decode step must run.

A decode step of R rows runs every linear of the model once on an (R, d_in) input and
attends, per row, to that row's context. Its floor is the larger of two times, both
measured on this machine in the caller's run:

1. **matmul**: every `nn.Linear` of the model (per layer the fused q/k/v projection,
   the output projection, the fused MLP gate/up and the MLP down projection; then the
   output head) as `F.linear` at its real shape, (R, d_in) @ (d_in, d_out), in the
   step's dtype, on a copy of the model's weights, in layer order, `passes` times in a
   row (warm weights, as in a run of decode steps). Seconds per pass.
2. **memory**: the bytes a step must read -- every weight once (the embedding table
   only as R rows, unless the head is tied to it) plus the K/V of every row's context
   (`keys` positions, all layers, K and V, in the step's dtype) -- over the read
   bandwidth measured at that working-set size: `torch.dot` of the two halves of an
   fp32 buffer of exactly those bytes, `passes` times in a row. A dot streams its
   operands and writes one number, so it measures reads alone (a copy would add writes
   and page faults; an fp32 `sum` measured 10-20% slower). The buffer has the step's
   size, not a fixed large one, because a small model's weights stay in the last-level
   cache between steps: a DRAM-sized probe would put the floor above what a step can
   do.

Each is timed at every thread count the engine's tuner may choose (its `candidates`;
fewer threads are skipped once a pass takes over its `explore_below`, as the tuner
does) and the least time counts, after one warm-up pass per count.

What the floor excludes: the attention scores and softmax (R x keys x heads x
head_dim multiply-adds per layer, small next to the linears at these lengths), RoPE,
norms, activations, the KV writes, the sampler, and all Python and scheduling
overhead. So a step at 1.0x its floor is impossible in practice and a ratio under
1.0 means the floor (or the timing) is wrong.

3. **ops** (the eager bound's other part): those excluded ops, each once per step as
   torch's CPU kernels run them, at the step's shapes, in the step's dtype, in
   forward order, on random data, timed like the matmuls; each in its cheapest form,
   so that no eager torch step can run less: per layer two `F.rms_norm`s, RoPE as one
   complex multiply of q and k (the engine's rotate-half form takes three kernels),
   attention of one query per row over `keys` contiguous keys without a mask (every
   row as long as the others; in fp32, as the engine attends; SDPA, or two matmuls
   with a softmax between, whichever pass is faster) and SiLU(gate) * up; then the
   embedding lookup of R tokens, the final
   norm, and two reductions over each row's logits: `max` (the greedy token, the
   cheapest choice) and the sum of `exp` (the logprob's normaliser; `logsumexp` and
   `argmax` took 1.4x as long). No views, no Python between them. Left out as
   avoidable: the residual adds (`addmm` can add the residual inside the output
   projections' matmuls) and the K/V writes (the projection, or RoPE's multiply, can
   write into the cache through `out=`).

The eager bound is max(matmul + ops, memory). Where it is already over a goal's
multiple of the floor, no step built from torch's eager CPU kernels reaches that goal,
whatever the engine around them does.

4. **sequence** (`sequence_seconds`, not part of the bound): part 1's matmuls and part
   3's ops interleaved in forward order, as one step runs them: each layer with its
   own weights and its own K/V (so each kernel finds the caches as the one before
   left them), attention by SDPA as the engine's, the residual adds inside the output
   projections' matmuls (`addmm`). Timed twice: called from Python, one call per
   kernel and no other work; and traced (`torch.jit.trace`, the token ids as its
   input so that nothing is folded into a constant): the same kernels with no Python
   between them. Part 3 times each kind of op in a loop of its own, where its data
   and code stay warm; inside a step the same op costs more. So sequence / floor is
   what the cheapest step written as eager Python calls can reach, and traced / floor
   what the same kernels reach once Python is out of the loop (a captured step
   without fusion). Neither is a strict bound (other kernels could beat them): part
   3 stays the bound.

This module knows nothing of the engine or of HF; it reads a model's weights and
shape and times torch kernels.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import common
import torch
import torch.nn.functional as F
from torch import nn

from prefixgym.engine.model import Transformer

__all__ = ["DecodeFloor", "FloorProbe", "least_seconds_per_pass"]


@dataclass(frozen=True)
class DecodeFloor:
    """One measured floor of a decode step; times are seconds per step."""

    matmul_s: float
    matmul_threads: int
    read_bytes: int
    bandwidth_Bps: float
    bandwidth_threads: int
    ops_s: float = 0.0
    ops_threads: int = 0
    sequence_s: float = 0.0  # part 4, from Python
    traced_s: float = 0.0  # part 4, traced

    @property
    def memory_s(self) -> float:
        return self.read_bytes / self.bandwidth_Bps

    @property
    def seconds(self) -> float:
        return max(self.matmul_s, self.memory_s)

    @property
    def bound(self) -> str:
        return "matmul" if self.matmul_s >= self.memory_s else "memory"

    @property
    def eager_s(self) -> float:
        """The eager bound: the matmuls and the other ops in sequence, or the reads."""
        return max(self.matmul_s + self.ops_s, self.memory_s)


def least_seconds_per_pass(fn: Callable[[], object], passes: int, counts: list[int],
                           skip_fewer_above_s: float, grad: bool = False) -> tuple[float, int]:
    """(least mean seconds per call of `fn` over `passes` calls, the thread count that gave it).

    Counts run largest first; once a call takes over `skip_fewer_above_s`, fewer threads
    are not tried (the engine tuner's rule: they cannot win there). `fn` runs in
    inference mode unless `grad` (autograd then records its ops).
    """
    best = (float("inf"), 0)
    for count in sorted(counts, reverse=True):
        with common.num_threads(count), torch.inference_mode(not grad):
            fn()  # warm-up: kernel selection, allocator, caches
            start = time.perf_counter()
            for _ in range(passes):
                fn()
            seconds = (time.perf_counter() - start) / passes
        best = min(best, (seconds, count))
        if seconds > skip_fewer_above_s:
            break
    return best


class FloorProbe:
    """Measures `DecodeFloor`s of one model in one dtype; build once, `measure` per repeat."""

    def __init__(self, model: Transformer, dtype: torch.dtype, thread_counts: list[int],
                 skip_fewer_above_s: float) -> None:
        # 1) the linears a decode step runs, in order: weights copied to the step's dtype
        linears: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for module in model.modules():
            if isinstance(module, nn.Linear):
                bias = None if module.bias is None else module.bias.detach().to(dtype)
                linears.append((module.weight.detach().to(dtype), bias))
        if model.output is None:  # tied head: the embedding matrix is the last matmul
            linears.append((model.tok_embeddings.weight.detach().to(dtype), None))
        self.linears = linears
        self.dtype = dtype
        self.config = model.config
        self.counts, self.skip_fewer_above_s = list(thread_counts), skip_fewer_above_s
        cfg = model.config
        # 2) bytes: weights other than the embedding table, and per row what varies
        self.element_size = torch.empty((), dtype=dtype).element_size()
        fixed = sum(p.numel() for name, p in model.named_parameters()
                    if name != "tok_embeddings.weight")
        if model.output is None:
            fixed += model.tok_embeddings.weight.numel()
        self.fixed_elements = fixed
        self.embedding_row_elements = 0 if model.output is None else cfg.dim
        self.kv_elements_per_key = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim

    def read_bytes(self, rows: int, keys: int) -> int:
        """Bytes a step of `rows` rows, each attending to `keys` positions, must read."""
        per_row = self.embedding_row_elements + keys * self.kv_elements_per_key
        return (self.fixed_elements + rows * per_row) * self.element_size

    def measure(self, rows: int, keys: int, passes: int, sequence: bool = False) -> DecodeFloor:
        """Time the step's matmuls, its reads and its other ops at (`rows`, `keys`),
        `passes` of each; with `sequence`, also part 4."""
        if rows < 1 or keys < 1 or passes < 1:
            raise ValueError(f"rows, keys and passes must be positive, got {rows}, {keys}, {passes}")
        matmul_s, matmul_threads = self.matmul_seconds(rows, passes)
        nbytes = self.read_bytes(rows, keys)
        half = max(1, nbytes // 8)  # fp32 elements per half
        buffer = torch.ones(2 * half)
        first, second = buffer[:half], buffer[half:]
        read_s, read_threads = least_seconds_per_pass(lambda: torch.dot(first, second), passes,
                                                      self.counts, self.skip_fewer_above_s)
        ops_s, ops_threads = self.ops_seconds(rows, keys, passes)
        sequence_s, traced_s = self.sequence_seconds(rows, keys, passes) if sequence else (0.0, 0.0)
        return DecodeFloor(matmul_s, matmul_threads, nbytes, buffer.nbytes / read_s, read_threads,
                           ops_s, ops_threads, sequence_s, traced_s)

    def matmul_seconds(self, rows: int, passes: int) -> tuple[float, int]:
        """(seconds per pass, thread count) of the step's linears at `rows` rows."""
        gen = torch.Generator().manual_seed(rows)
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen).to(self.dtype)
                  for w, _ in self.linears}  # (R, d_in) per input width

        def matmuls() -> None:
            for weight_out_in, bias in self.linears:
                F.linear(inputs[weight_out_in.shape[1]], weight_out_in, bias)  # (R, d_out)

        return least_seconds_per_pass(matmuls, passes, self.counts, self.skip_fewer_above_s)

    def ops_seconds(self, rows: int, keys: int, passes: int) -> tuple[float, int]:
        """(seconds per pass, thread count) of the step's other ops (module docstring, 3)."""
        cfg, dt, R = self.config, self.dtype, rows
        H, Hkv, D, C = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim
        gen = torch.Generator().manual_seed(rows)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dt)

        h, norm_w, table = rand(R, 1, C), rand(C), rand(cfg.vocab_size, C)
        qk = torch.view_as_complex(torch.randn(R, H + Hkv, 1, D // 2, 2, generator=gen))
        freqs = torch.view_as_complex(torch.randn(R, 1, 1, D // 2, 2, generator=gen))
        # attention in fp32 whatever the model's dtype: the engine keeps K/V in fp32, and
        # on CPU fp32 SDPA is faster than bf16 for one-query steps (layers.py)
        q = torch.randn(R, H, 1, D, generator=gen)
        k_all, v_all = (torch.randn(R, Hkv, keys, D, generator=gen) for _ in range(2))
        q_grouped = q.view(R, Hkv, H // Hkv, D)  # a kv head's queries as rows of one matmul
        gate, up = rand(R, 1, cfg.hidden_dim), rand(R, 1, cfg.hidden_dim)
        logits, tokens = torch.randn(R, cfg.vocab_size, generator=gen), torch.zeros(R, dtype=torch.long)

        def sdpa() -> None:
            F.scaled_dot_product_attention(q, k_all, v_all, enable_gqa=Hkv != H)

        def grouped_matmuls() -> None:  # faster than SDPA at many rows here
            scores = torch.matmul(q_grouped, k_all.transpose(-1, -2))
            torch.matmul(scores.softmax(dim=-1), v_all)

        def ops(attention: Callable[[], None]) -> None:
            F.embedding(tokens, table)
            for _ in range(cfg.n_layers):
                F.rms_norm(h, (C,), norm_w, cfg.norm_eps)
                torch.view_as_real(qk * freqs)
                attention()
                F.rms_norm(h, (C,), norm_w, cfg.norm_eps)
                torch.mul(F.silu(gate), up)
            F.rms_norm(h, (C,), norm_w, cfg.norm_eps)
            torch.max(logits, dim=-1)  # the greedy token
            logits.exp().sum(dim=-1)  # the logprobs' normaliser, unstabilised (cheapest)

        return min(least_seconds_per_pass(lambda: ops(attention), passes, self.counts,
                                          self.skip_fewer_above_s)
                   for attention in (sdpa, grouped_matmuls))

    def sequence_seconds(self, rows: int, keys: int, passes: int,
                         traced: bool = True) -> tuple[float, float]:
        """(seconds per pass from Python, seconds per pass traced) of part 4's sequence,
        each the least over the thread counts; without `traced` the second is 0.0 and
        neither traced nor timed. Attention is SDPA's, as the engine's."""
        cfg, dt, R = self.config, self.dtype, rows
        H, Hkv, D, C, L = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim, cfg.n_layers
        gen = torch.Generator().manual_seed(rows)
        weights = [w for w, _ in self.linears]  # per layer qkv, wo, gate_up, down; the head
        table = torch.randn(cfg.vocab_size, C, generator=gen).to(dt)
        tokens = torch.zeros(R, dtype=torch.long)
        norm_w = [torch.randn(C, generator=gen).to(dt) for _ in range(2 * L + 1)]
        freqs = torch.view_as_complex(torch.randn(R, H + Hkv, D // 2, 2, generator=gen))
        kv = [(torch.randn(R, Hkv, keys, D, generator=gen), torch.randn(R, Hkv, keys, D, generator=gen))
              for _ in range(L)]  # fp32, as the engine attends (see `ops_seconds`)

        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=Hkv != H)

        def step(ids_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = F.embedding(ids_R, table)  # (R, C)
            for layer in range(L):
                wqkv, wo, wgu, wd = weights[4 * layer : 4 * layer + 4]
                n = F.rms_norm(x, (C,), norm_w[2 * layer], cfg.norm_eps)
                qkv = F.linear(n, wqkv).view(R, H + 2 * Hkv, D // 2, 2)
                qk = torch.view_as_real(torch.view_as_complex(qkv[:, : H + Hkv]) * freqs)
                y = attention(qk[:, :H].reshape(R, H, D).float(), *kv[layer])
                x = torch.addmm(x, y.reshape(R, H * D).to(dt), wo.t())
                n = F.rms_norm(x, (C,), norm_w[2 * layer + 1], cfg.norm_eps)
                gate, up = F.linear(n, wgu).chunk(2, dim=-1)
                x = torch.addmm(x, torch.mul(F.silu(gate), up), wd.t())
            logits = F.linear(F.rms_norm(x, (C,), norm_w[-1], cfg.norm_eps), weights[-1]).float()
            return torch.max(logits, dim=-1).values, logits.exp().sum(dim=-1)

        python_s = least_seconds_per_pass(lambda: step(tokens), passes, self.counts,
                                          self.skip_fewer_above_s)[0]
        if not traced:
            return python_s, 0.0
        # the tokens are the trace's input, so that nothing after them is a constant
        # TorchScript could fold away
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # TorchScript's deprecation notice
            step_trace = torch.jit.trace(step, (tokens,), check_trace=False)
        traced_s = least_seconds_per_pass(lambda: step_trace(tokens), passes, self.counts,
                                          self.skip_fewer_above_s)[0]
        return python_s, traced_s
