"""torch.compile against the eager engine, on the two phases of the GRPO-vs-TRL step.

`bench_grpo_trl.py` puts our GRPO step at ~2.5x faster than TRL's (the goal of
issue 14 is 3x) and within 1.4-1.5x of the cost of its kernels run back to back. The
usual tool for what is left is `torch.compile`: Inductor fuses the elementwise ops
around the matmuls (norms, RoPE, SiLU x up, residual adds) into generated C++ loops,
forward and backward. This script measures what it gives here, on that bench's shapes
(`tiny` preset; B = 8 prompts of 57 tokens, a 45-token system prompt shared by all
and 12 tokens of their own; G = 8 replies of 32 tokens), in one run:

  update      `forward_backward` + `optim_step` of the 64 datums (shared prefixes,
              loss importance_sampling, advantages / loss tokens): the eager
              `TrainingClient` vs one whose blocks run compiled, ABBA rounds after a
              warm-up round (which pays the compile). Then one eager pass (its
              gradients dropped) plain and under `torch.profiler`: its time in
              `aten::mm`, their GFLOP/s, this CPU's 1024^3 matmul peak right after,
              and its time in SDPA's kernels.
  generation  8 `sample(num_samples=8)` requests of 32 tokens at once: the eager engine
              vs one whose blocks run compiled (a `LocalService` on each model), ABBA.

"Compiled blocks": each decoder block's pure-tensor parts (norm, qkv projection and
RoPE; output projection, residual, norm, SwiGLU, residual) as two `torch.compile`d
functions with dynamic shapes, calling the engine's own norm and RoPE (`layers.py`).
The keys/values hand-off (`KVView.update`, a Python object) and SDPA stay eager:
compiling whole blocks traces into the KV views, which recompiles per layer and wave
shape until dynamo's recompile limit sends it back to eager. Compiled kernels round
differently: the largest |logprob diff| of the first update's outputs is printed.
Inductor on CPU needs a C++ compiler; without one the script says so and exits.

    .venv/bin/python bench/bench_compile.py                       # both parts
    .venv/bin/python bench/bench_compile.py --part update --rounds 6

Knows the model's blocks, the training client and the local service; not envs.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from collections.abc import Callable

import common  # sets OMP_WAIT_POLICY=PASSIVE before torch starts its threads
import torch
import torch.nn.functional as F
from bench_matmul_peak import measure_matmul_peak
from bench_shared_prefix import VOCAB, _datum, _ids
from torch.profiler import ProfilerActivity, profile

from prefixgym.engine.model import Transformer, load_model
from prefixgym.engine.model.layers import Block, KVView, _apply_rope, _rms_norm
from prefixgym.engine.trainer.train_batch import prepare_request
from prefixgym.engine.trainer.train_pass import PassOptions, autocast_for, run_pass
from prefixgym.engine.trainer.training import TrainingClient
from prefixgym.local_service import LocalService
from prefixgym.types import AdamParams, Datum, ModelInput, SamplingParams

SYSTEM, USER, REPLY, PROMPTS, G = 45, 12, 32, 8, 8
Tensor = torch.Tensor


def _pre_attention(h: Tensor, norm_w: Tensor, eps: float, wqkv: Tensor, cos: Tensor,
                   sin: Tensor, H: int, Hkv: int, D: int) -> tuple[Tensor, Tensor, Tensor]:
    B, T, _ = h.shape
    qkv = F.linear(_rms_norm(h, norm_w, eps), wqkv).view(B, T, H + 2 * Hkv, D).transpose(1, 2)
    qk = _apply_rope(qkv[:, : H + Hkv], cos, sin)
    return qk[:, :H], qk[:, H:], qkv[:, H + Hkv :]


def _post_attention(h: Tensor, y: Tensor, wo: Tensor, norm_w: Tensor, eps: float,
                    w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    h = h + F.linear(y, wo)
    gate, up = F.linear(_rms_norm(h, norm_w, eps), w_gate_up).chunk(2, dim=-1)
    return h + F.linear(F.silu(gate) * up, w_down)


_PRE = torch.compile(_pre_attention, dynamic=True)
_POST = torch.compile(_post_attention, dynamic=True)


class CompiledBlock(Block):
    """`Block` with its pure-tensor parts compiled (no biases, no LoRA: the presets')."""

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, kv: KVView | None) -> Tensor:
        a = self.attn
        B, T, _ = h.shape
        H, Hkv, D = a.n_heads, a.n_kv_heads, a.head_dim
        q, k, v = _PRE(h, self.attn_norm.weight, self.attn_norm.eps, a.wqkv.weight, cos, sin,
                       H, Hkv, D)
        if kv is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hkv != H)
        else:
            k_all, v_all, mask = kv.update(a.layer_idx, k, v)
            q_attn = q if k_all.dtype == q.dtype else q.to(k_all.dtype)
            y = F.scaled_dot_product_attention(q_attn, k_all, v_all, attn_mask=mask,
                                               is_causal=mask is None and T > 1,
                                               enable_gqa=Hkv != H).to(q.dtype)
        return _POST(h, y.transpose(1, 2).reshape(B, T, H * D), a.wo.weight,
                     self.mlp_norm.weight, self.mlp_norm.eps, self.mlp.w_gate_up.weight,
                     self.mlp.w_down.weight)


def model_pair(preset: str) -> dict[str, Transformer]:
    """Two copies of the same weights; the second's blocks compiled (deep copies, such
    as the sampler's snapshots, keep the class)."""
    models = {name: load_model(preset, seed=0) for name in ("eager", "compiled")}
    for layer in models["compiled"].layers:
        layer.__class__ = CompiledBlock
    return models


def update_batch(seed: int = 0) -> list[Datum]:
    gen = torch.Generator().manual_seed(seed)
    system = _ids(gen, SYSTEM)
    datums = []
    for _ in range(PROMPTS):
        user = _ids(gen, USER)
        datums += [_datum([(system, False), (user, False), (_ids(gen, REPLY), True)],
                          PROMPTS * G * REPLY, gen) for _ in range(G)]
    return datums


def abba(contenders: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each contender, rounds alternating AB / BA; round 0 dropped."""
    names = list(contenders)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds + 1):
        for name in (names if r % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            contenders[name]()
            if r > 0:
                seconds[name].append(time.perf_counter() - start)
            else:
                print(f"  warm-up round, {name}: {time.perf_counter() - start:.1f} s", flush=True)
    return seconds


def print_ratio(what: str, seconds: dict[str, list[float]]) -> None:
    print(f"| {what} | s, median (min-max) |")
    print("|---|---:|")
    for name, values in seconds.items():
        print(f"| {name} | {common.spread(values, '{:.3f}')} |")
    ratio = statistics.median(seconds["eager"]) / statistics.median(seconds["compiled"])
    print(f"eager / compiled: {ratio:.2f}x (median); >1 means compiling helps\n", flush=True)


def profile_eager_pass(model: Transformer, datums: list[Datum]) -> None:
    """The eager forward+backward under torch.profiler: its matmuls against the peak."""
    cfg = model.config
    prepared, spec, config = prepare_request(datums, "importance_sampling", None,
                                             cfg.vocab_size, cfg.max_seq_len)
    options = PassOptions(8192, True, True, False, autocast_for(model, torch.float32))
    params = list(model.parameters())
    start = time.perf_counter()
    run_pass(model, params, prepared, spec, config, True, options)
    unprofiled = time.perf_counter() - start
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run_pass(model, params, prepared, spec, config, True, options)
    wall = time.perf_counter() - start
    mm_s, flops, attention_s = 0.0, 0.0, 0.0
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key == "aten::mm":
            (m, k), (_, n) = event.input_shapes[:2]
            mm_s += event.self_cpu_time_total / 1e6
            flops += 2.0 * m * k * n * event.count
        elif event.key.startswith("aten::_scaled_dot_product"):  # SDPA's kernels, both ways
            attention_s += event.self_cpu_time_total / 1e6
    peak = measure_matmul_peak(torch.float32)
    rate = flops / mm_s / 1e9
    print(f"eager forward_backward: {unprofiled:.3f} s ({wall:.3f} s under the profiler); "
          f"aten::mm {mm_s:.3f} s, {mm_s / unprofiled:.0%} of the unprofiled pass, at "
          f"{rate:.1f} GFLOP/s; this CPU's fp32 1024^3 peak right after: {peak:.1f} GFLOP/s "
          f"(mm at {rate / peak:.2f} of it); SDPA forward+backward {attention_s:.3f} s\n",
          flush=True)


def part_update(args: argparse.Namespace) -> None:
    datums = update_batch()
    models = model_pair(args.preset)
    clients = {name: TrainingClient(model) for name, model in models.items()}
    first = {name: client.forward_backward(datums, "importance_sampling").result()
             for name, client in clients.items()}
    diff = max(abs(a - b) for x, y in zip(first["eager"].loss_fn_outputs,
                                          first["compiled"].loss_fn_outputs)
               for a, b in zip(x["logprobs"], y["logprobs"]))
    print(f"update: {len(datums)} datums, train computed "
          f"{first['eager'].usage.train_computed_tokens:,} positions; max |logprob diff| "
          f"eager vs compiled {diff:.2e}", flush=True)
    adam = AdamParams(learning_rate=1e-4)

    def step(client: TrainingClient) -> Callable[[], object]:
        def run() -> object:
            client.forward_backward(datums, "importance_sampling").result()
            return client.optim_step(adam).result()
        return run

    print_ratio("update (forward_backward + optim_step)",
                abba({name: step(c) for name, c in clients.items()}, args.rounds))
    profile_eager_pass(models["eager"], datums)


def part_generation(args: argparse.Namespace) -> None:
    gen = torch.Generator().manual_seed(1)
    system = _ids(gen, SYSTEM)
    params = SamplingParams(max_tokens=REPLY, temperature=1.0)
    services = {name: LocalService(model, seed=0) for name, model in model_pair(args.preset).items()}
    clients = {name: s.create_sampling_client() for name, s in services.items()}
    sampled: dict[str, int] = {}

    def generate(name: str) -> Callable[[], object]:
        def run() -> object:
            prompts = [system + _ids(gen, USER) for _ in range(PROMPTS)]
            futures = [clients[name].sample(ModelInput.from_ints(p), num_samples=G,
                                            sampling_params=params) for p in prompts]
            sampled[name] = sum(len(s.tokens) for f in futures for s in f.result().sequences)
            return sampled[name]
        return run

    print(f"generation: {PROMPTS} prompts x {G} samples x {REPLY} tokens", flush=True)
    seconds = abba({name: generate(name) for name in services}, args.rounds)
    print(f"tokens sampled in the last round: {sampled}")
    print_ratio("generation", seconds)
    for service in services.values():
        service.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("update", "generation", "all"), default="all")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds after the warm-up")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        sys.exit("torch.compile (Inductor) needs a C++ compiler on CPU; none found")
    common.setup_threads(args.threads)
    print(common.machine_facts(), flush=True)
    if load_model(args.preset, seed=0).config.vocab_size != VOCAB:
        sys.exit(f"--preset {args.preset}: the batches draw token ids below {VOCAB}; "
                 "pick a preset with that vocabulary (tiny, small)")
    if args.part in ("update", "all"):
        part_update(args)
    if args.part in ("generation", "all"):
        part_generation(args)


if __name__ == "__main__":
    main()
