"""Prefill throughput of the engine as a fraction of this machine's matmul peak.

Part 1 (`peak`): B prompts of L random tokens, one shared forward (max_tokens=1, no
prefix cache), fp32 and bf16. FLOPs = 2 x non-embedding params x tokens + attention
(4 x heads x head_dim per query-key pair over the causal triangle, every layer) +
the output head on each row's last position. The matmul peak is measured in the same
run with `bench_matmul_peak.measure_matmul_peak(dtype)`, interleaved.

Part 2 (`suffix`): the GRPO shape -- R requests, each a cached 400-token prefix plus
its own 10-30-token suffix, arriving together -- prefilled in one batched forward vs
one forward per request (the engine before batching), same weights, interleaved.

Part 3 (`drift`): bf16 vs fp32 sampler on the same weights: logprob differences,
teacher-forced and on bf16-sampled tokens, and how often seeded samples agree.

    .venv/bin/python bench/bench_prefill.py            # both parts, tiny and small
    .venv/bin/python bench/bench_prefill.py --quick    # tiny only, 1 repeat
"""

from __future__ import annotations

import argparse
import random

import common
import torch
from bench_matmul_peak import measure_matmul_peak

from prefixgym.engine.model import ModelConfig, count_parameters
from prefixgym.local_service import LocalService
from prefixgym.types import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0.0)


def prefill_flops(cfg: ModelConfig, non_embedding: int, batch: int, length: int) -> float:
    linear = 2.0 * non_embedding * batch * length
    pairs = batch * length * (length + 1) / 2  # causal query-key pairs
    attention = 4.0 * cfg.n_heads * cfg.head_dim * pairs * cfg.n_layers
    head = 2.0 * cfg.dim * cfg.vocab_size * batch
    return linear + attention + head


def run_all(svc: LocalService, prompts: list[list[int]], params: SamplingParams = ONE) -> float:
    sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
    svc.engine.pause()  # queue everything, then let one wave take it
    futures = [sampler.sample(p, sampling_params=params) for p in prompts]

    def go() -> None:
        svc.engine.resume()
        for f in futures:
            f.result()

    return common.timed(go)[0]


def part_peak(preset: str, batch: int, length: int, repeats: int) -> None:
    for dtype in ("float32", "bfloat16"):
        svc = LocalService(preset, seed=0, prefix_cache=False, dtype=dtype)
        cfg = svc.train_model.config
        flops = prefill_flops(cfg, count_parameters(svc.train_model, non_embedding=True),
                              batch, length)
        rng = random.Random(0)
        prompts = [[rng.randrange(1, cfg.vocab_size) for _ in range(length)] for _ in range(batch)]
        run_all(svc, prompts)  # warm-up
        tps, fracs, peaks = [], [], []
        for _ in range(repeats):
            peak = measure_matmul_peak(getattr(torch, dtype), max_seconds=2.0)
            seconds = run_all(svc, prompts)
            tps.append(batch * length / seconds)
            fracs.append(flops / seconds / 1e9 / peak)
            peaks.append(peak)
        print(f"[{preset} {dtype}] {batch}x{length} tokens: prefill {common.spread(tps, '{:.0f}')} "
              f"tok/s, {flops / 1e9:.1f} GFLOP per run, matmul peak "
              f"{common.spread(peaks, '{:.1f}')} GFLOP/s, fraction of peak "
              f"{common.spread(fracs, '{:.2f}')}", flush=True)
        svc.close()


def part_suffix(preset: str, requests: int, repeats: int) -> None:
    rng = random.Random(1)
    prefix = [rng.randrange(1, 4000) for _ in range(400)]
    suffixes = [[rng.randrange(1, 4000) for _ in range(rng.randint(10, 30))]
                for _ in range(requests)]
    times: dict[str, list[float]] = {"batched": [], "one per call": []}
    for _ in range(repeats):
        for mode in ("batched", "one per call"):
            with LocalService(preset, seed=0) as svc:
                sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
                sampler.sample(prefix + [1], sampling_params=ONE).result()  # cache the prefix
                if mode == "one per call":
                    svc.engine.scheduler.max_prefill_tokens = 1  # every request is its own chunk
                calls = svc.engine_stats()["prefill_calls"]
                times[mode].append(run_all(svc, [prefix + s for s in suffixes]))
                calls = svc.engine_stats()["prefill_calls"] - calls
                usage = svc.usage()
                assert usage.prefill_cached_tokens == requests * 400
        print(f"[{preset}] {requests} requests x (400 cached + 10-30 new) [{mode}: {calls} calls]")
    tokens = sum(len(s) for s in suffixes)
    for mode, values in times.items():
        print(f"[{preset}]   {mode:>12}: {common.spread(values)} s = "
              f"{tokens / min(values):.0f} new tok/s (best)")
    print(f"[{preset}]   speed-up of batching: "
          f"{min(times['one per call']) / min(times['batched']):.2f}x (best vs best), "
          f"per repeat {[round(b / a, 2) for a, b in zip(times['batched'], times['one per call'])]}")


def part_drift(preset: str, sequences: int = 8, length: int = 256) -> None:
    """bf16 vs fp32 on the same weights: logprob drift, teacher-forced and as sampled."""
    rng = random.Random(2)
    fp32 = LocalService(preset, seed=0)
    bf16 = LocalService(preset, seed=0, dtype="bfloat16")
    prompts = [[rng.randrange(1, 4000) for _ in range(length)] for _ in range(sequences)]
    forced = []
    for p in prompts:
        a = fp32.create_sampling_client().compute_logprobs(p).result()[1:]
        b = bf16.create_sampling_client().compute_logprobs(p).result()[1:]
        forced += [abs(x - y) for x, y in zip(a, b)]
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=3)
    sampled, same = [], 0
    for p in prompts:
        bf16.create_sampling_client(False).sample(p[:64], sampling_params=ONE).result()  # cache
        resp = bf16.create_sampling_client(False).sample(p[:200], sampling_params=params).result()
        seq = resp.sequences[0]
        ref = fp32.create_sampling_client().compute_logprobs(p[:200] + seq.tokens).result()[200:]
        sampled += [abs(x - y) for x, y in zip(seq.logprobs, ref)]
        other = fp32.create_sampling_client(False).sample(p[:200], sampling_params=params).result()
        same += other.sequences[0].tokens == seq.tokens
    forced.sort()
    sampled.sort()
    print(f"[{preset}] bf16 vs fp32 |logprob diff| teacher-forced over {len(forced)} positions: "
          f"mean {sum(forced) / len(forced):.4f}, p99 {forced[int(0.99 * len(forced))]:.4f}, "
          f"max {forced[-1]:.4f}; bf16-sampled tokens (cached prefix) vs fp32 recompute: "
          f"mean {sum(sampled) / len(sampled):.4f}, max {sampled[-1]:.4f}; "
          f"identical 32-token samples with the same seed: {same}/{len(prompts)}")
    fp32.close()
    bf16.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--parts", nargs="+", default=["peak", "suffix", "drift"])
    parser.add_argument("--quick", action="store_true", help="tiny only, 1 repeat")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        args.presets, args.repeats = ["tiny"], 1
    common.setup_threads(args.threads)
    print(common.machine_facts())
    for preset in args.presets:
        if "peak" in args.parts:
            part_peak(preset, args.batch, args.length, args.repeats)
        if "suffix" in args.parts:
            part_suffix(preset, args.requests, args.repeats)
        if "drift" in args.parts:
            part_drift(preset)


if __name__ == "__main__":
    main()
