"""Train throughput: prefixgym's TrainingClient (fp32, bf16) vs transformers' Llama.

One step = forward + backward + AdamW over a batch of `--batch` x `--seq` random
tokens. Four contenders start from identical weights (the HF model is a copy of the
built-in one, `common.hf_llama_from`):

    ours-fp32   TrainingClient(model)                              cross_entropy
    ours-bf16   TrainingClient(model, TrainerOptions(compute_dtype=torch.bfloat16)) (autocast, fp32 master)
    hf-fp32     LlamaForCausalLM(labels=...) + torch.optim.AdamW
    hf-bf16     the same under torch.autocast("cpu", torch.bfloat16)

They run interleaved, one step each per round (ABCD ABCD ...), so load changes on a
shared machine hit all of them alike; best-of and median wall-clock tokens/s are
reported, and tokens per CPU-second of this process (median), which other processes'
load disturbs less than wall time.
prefixgym's step includes its request validation and padding; HF's loss is the mean
cross-entropy of `labels=` (same compute, other scale).

Achieved FLOP/s use, per step of N = batch x seq tokens,

    FLOPs = 6 x (P_nonemb + V x dim) x N  +  3 x n_layers x 4 x dim x pairs

P_nonemb = parameters without embedding and output head (the head's V x dim matmul is
counted separately; the embedding lookup is not a matmul), pairs = batch x seq(seq+1)/2
causal query-key pairs (QK^T and PV cost 2 x dim each per pair forward; backward is
twice forward). It is divided by the fp32 and bf16 `torch.matmul` peaks measured in
the same run (`bench_matmul_peak.measure_matmul_peak`, before and after, best kept).

Also reported: the target-logprob drift of the bf16 forward vs fp32 on the same
weights (ours and HF), and ours-fp32 vs hf-fp32 as a sanity check. Run by hand:

    .venv/bin/python bench/bench_train.py                      # tiny and small, 5 rounds
    .venv/bin/python bench/bench_train.py --presets tiny --rounds 2
    .venv/bin/python bench/bench_train.py --presets tiny --memory-peers --no-hf  # head, recompute

`--memory-peers` adds ours-fp32 with the plain head (`chunked_head=False`; ours-fp32
runs the default chunked head) and with `recompute_activations=True`.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import common  # sets OMP_WAIT_POLICY=PASSIVE before torch starts its threads
import torch
from bench_matmul_peak import measure_matmul_peak

from prefixgym.engine.model import PRESETS, ModelConfig, Transformer, count_parameters, load_model
from prefixgym.engine.trainer.options import TrainerOptions
from prefixgym.engine.trainer.training import TrainingClient
from prefixgym.types import AdamParams, Datum, ModelInput

LR = 1e-4


def train_flops(cfg: ModelConfig, non_embedding: int, batch: int, seq: int) -> float:
    tokens = batch * seq
    matmuls = 6.0 * (non_embedding + cfg.vocab_size * cfg.dim) * tokens
    pairs = batch * seq * (seq + 1) / 2
    attention = 3.0 * cfg.n_layers * 4.0 * cfg.n_heads * cfg.head_dim * pairs
    return matmuls + attention


def datums_of(tokens_B_T1: torch.Tensor) -> list[Datum]:
    return [
        Datum(model_input=ModelInput.from_ints(r[:-1]), loss_fn_inputs={"target_tokens": r[1:]})
        for r in tokens_B_T1.tolist()
    ]


def ours_step(model: Transformer, dtype: torch.dtype, datums: list[Datum],
              **options: bool) -> Callable[[], None]:
    client = TrainingClient(model, TrainerOptions(compute_dtype=dtype, **options))
    adam = AdamParams(learning_rate=LR)

    def step() -> None:
        client.forward_backward(datums, "cross_entropy")
        client.optim_step(adam).result()

    return step


def hf_step(hf: Any, bf16: bool, tokens_B_T1: torch.Tensor) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(hf.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-12)
    inputs, labels = tokens_B_T1[:, :-1], tokens_B_T1.clone()

    def step() -> None:
        cast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with cast:
            # HF shifts labels itself: position t predicts labels[t + 1].
            loss = hf(input_ids=inputs, labels=labels[:, :-1]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def target_logprobs_ours(model: Transformer, dtype: torch.dtype, datums: list[Datum]) -> torch.Tensor:
    out = TrainingClient(model, TrainerOptions(compute_dtype=dtype)).forward(datums, "cross_entropy").result()
    return torch.tensor([o["logprobs"] for o in out.loss_fn_outputs], dtype=torch.float64)


def target_logprobs_hf(hf: Any, bf16: bool, tokens_B_T1: torch.Tensor) -> torch.Tensor:
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with torch.no_grad(), cast:
        logits = hf(input_ids=tokens_B_T1[:, :-1]).logits.float()
    logp = torch.log_softmax(logits, -1).gather(-1, tokens_B_T1[:, 1:, None])[..., 0]
    return logp.double()


def drift(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = (a - b).abs()
    return f"max {diff.max().item():.4f}  mean {diff.mean().item():.5f}"


def bench_preset(preset: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = PRESETS[preset]
    gen = torch.Generator().manual_seed(0)
    tokens_B_T1 = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
    datums = datums_of(tokens_B_T1)
    base = load_model(preset, seed=0)
    non_embedding = count_parameters(base, non_embedding=True)

    # Logprob drift on identical weights, before any training.
    hf0 = common.hf_llama_from(base)
    lp_ours32 = target_logprobs_ours(base, torch.float32, datums)
    lp_ours16 = target_logprobs_ours(base, torch.bfloat16, datums)
    lp_hf32 = target_logprobs_hf(hf0, False, tokens_B_T1)
    lp_hf16 = target_logprobs_hf(hf0, True, tokens_B_T1)
    print(f"[{preset}] logprob drift  ours bf16 vs fp32: {drift(lp_ours16, lp_ours32)}")
    print(f"[{preset}] logprob drift  hf   bf16 vs fp32: {drift(lp_hf16, lp_hf32)}")
    print(f"[{preset}] sanity         ours fp32 vs hf fp32: {drift(lp_ours32, lp_hf32)}")
    del hf0

    def hf_model() -> Any:
        return common.hf_llama_from(base).requires_grad_(True).train()

    steps: dict[str, Callable[[], None]] = {
        "ours-fp32": ours_step(base.copy().requires_grad_(True).train(), torch.float32, datums),
        "ours-bf16": ours_step(base.copy().requires_grad_(True).train(), torch.bfloat16, datums),
    }
    if args.memory_peers:  # the training client's memory options, same weights and data
        def fresh() -> Transformer:
            return base.copy().requires_grad_(True).train()
        steps["fp32-plainhead"] = ours_step(fresh(), torch.float32, datums, chunked_head=False)
        steps["fp32-recompute"] = ours_step(fresh(), torch.float32, datums,
                                            recompute_activations=True)
    if not args.no_hf:
        steps["hf-fp32"] = hf_step(hf_model(), False, tokens_B_T1)
        steps["hf-bf16"] = hf_step(hf_model(), True, tokens_B_T1)
    for step in steps.values():  # warm-up: optimizer state, kernel selection
        step()
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    cpu_seconds: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            step()
            seconds[name].append(time.perf_counter() - start)
            cpu_seconds[name].append(time.process_time() - cpu_start)

    tokens = args.batch * args.seq
    flops = train_flops(cfg, non_embedding, args.batch, args.seq)
    print(
        f"[{preset}] non-embedding params {non_embedding / 1e6:.2f}M, "
        f"{flops / 1e9:.1f} GFLOP per step of {tokens} tokens"
    )
    return {"tokens": tokens, "flops": flops, "seconds": seconds, "cpu_seconds": cpu_seconds}


def report(preset: str, result: dict[str, Any], peaks: dict[torch.dtype, float]) -> None:
    tokens, flops, seconds = result["tokens"], result["flops"], result["seconds"]
    cpu_seconds = result["cpu_seconds"]
    peer = "hf-fp32" if "hf-fp32" in seconds else "ours-fp32"
    hf32_best = tokens / min(seconds[peer])
    hf32_cpu = tokens / statistics.median(cpu_seconds[peer])
    print(
        f"[{preset}]{'':3s} {'best tok/s':>10s} {'median':>8s} {'vs ' + peer:>10s} "
        f"{'GFLOP/s':>8s} {'%fp32 pk':>8s} {'%bf16 pk':>8s} {'tok/cpu-s':>9s} {'vs hf':>6s}"
    )
    for name, secs in seconds.items():
        best = tokens / min(secs)
        median = tokens / statistics.median(secs)
        gflops = flops / min(secs) / 1e9
        per_cpu = tokens / statistics.median(cpu_seconds[name])
        print(
            f"{name:10s} {best:10.0f} {median:8.0f} {best / hf32_best:9.2f}x "
            f"{gflops:8.1f} {100 * gflops / peaks[torch.float32]:7.1f}% "
            f"{100 * gflops / peaks[torch.bfloat16]:7.1f}% {per_cpu:9.0f} "
            f"{per_cpu / hf32_cpu:5.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per contender")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory-peers", action="store_true",
                        help="also ours-fp32 with chunked_head=False and with "
                             "recompute_activations=True (interleaved with the rest)")
    parser.add_argument("--no-hf", action="store_true",
                        help="leave out the HF contenders (ratios then vs ours-fp32)")
    args = parser.parse_args()
    common.setup_threads(args.threads)
    torch.manual_seed(0)
    print(common.machine_facts())
    print(f"batch={args.batch} seq={args.seq} rounds={args.rounds}")
    dtypes = (torch.float32, torch.bfloat16)
    peaks = {dt: measure_matmul_peak(dt) for dt in dtypes}
    results = {preset: bench_preset(preset, args) for preset in args.presets}
    for dt in dtypes:  # again at the end; the best of both is the machine's peak
        peaks[dt] = max(peaks[dt], measure_matmul_peak(dt))
    print(
        f"matmul peak (best of start/end): fp32 {peaks[torch.float32]:.1f} GFLOP/s, "
        f"bf16 {peaks[torch.bfloat16]:.1f} GFLOP/s"
    )
    for preset, result in results.items():
        report(preset, result, peaks)
    print(common.machine_facts())


if __name__ == "__main__":
    main()
