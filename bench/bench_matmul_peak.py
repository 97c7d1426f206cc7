"""Measure this CPU's matmul peak (GFLOP/s) for fp32 and bf16: `torch.matmul` and `F.linear`.

Other benchmarks import `measure_matmul_peak(dtype)` to express their throughput as a
fraction of what the machine can do. Each measurement is the best of a few square
products under a small time budget, so a run takes seconds, not minutes. Both
`torch.matmul` and `F.linear` (what the models' layers run) are timed and the faster
counts: on a CPU without native bf16 (AVX2 only) a bf16 `matmul` takes a reference
path ~15x slower than bf16 `linear`, which made every bf16 "fraction of peak" > 1.
It uses torch's current thread count; pass --threads to change it from the command line.

This script knows nothing about models; it only times matrix products.

    python bench/bench_matmul_peak.py [--threads N] [--size 1024] [--seconds 3]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

__all__ = ["measure_matmul_peak"]


def measure_matmul_peak(
    dtype: torch.dtype = torch.float32,
    size: int = 1024,
    repeats: int = 10,
    max_seconds: float = 3.0,
) -> float:
    """Best observed GFLOP/s of a `size`x`size` by `size`x`size` product in `dtype`,
    by `torch.matmul` or `F.linear` (the same FLOPs; the weight transposed).

    Per op: one warm-up product, then up to `repeats` timed ones, stopping early once
    `max_seconds` have passed (at least one timed product always runs).
    """
    if size <= 0 or repeats <= 0 or max_seconds <= 0:
        raise ValueError(
            f"size, repeats and max_seconds must be positive, got {size}, {repeats}, {max_seconds}"
        )
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    best = float("inf")
    with torch.inference_mode():
        for product in (lambda: torch.matmul(a, b, out=out), lambda: F.linear(a, b)):
            product()  # warm-up: allocations, kernel selection
            deadline = time.perf_counter() + max_seconds / 2
            for _ in range(repeats):
                start = time.perf_counter()
                product()
                best = min(best, time.perf_counter() - start)
                if time.perf_counter() > deadline:
                    break
    return 2.0 * size**3 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: as is)")
    parser.add_argument("--size", type=int, default=1024, help="square matrix side")
    parser.add_argument("--seconds", type=float, default=3.0, help="time budget per dtype")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), size {args.size}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for dtype in (torch.float32, torch.bfloat16):
        gflops = measure_matmul_peak(dtype, size=args.size, max_seconds=args.seconds)
        print(f"{str(dtype).removeprefix('torch.'):>9}: {gflops:8.1f} GFLOP/s")


if __name__ == "__main__":
    main()
