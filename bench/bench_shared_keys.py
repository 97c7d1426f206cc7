"""One decode step with and without shared keys (engine/sampler/shared_keys.py).

`rows` rows whose block tables begin with the same `--shared` positions (a GRPO group's
prompt, a system prompt), each at ~`--positions` (rows 0-6 positions apart, so the step
needs a mask), on the engine's own decode path: a `DecodeWorkspace` gathered from a KV
pool, a `DecodeView`, the packed inference model. Peers, interleaved `--repeats` times
in this process: the step reading every row's keys (the workspace without a plan) and
the step reading the shared ones once. Prints ms a step (least of the repeats), the
ratio, and the largest logit difference between the two.

    .venv/bin/python bench/bench_shared_keys.py --dtype bfloat16 --shared 112
    .venv/bin/python bench/bench_shared_keys.py --dtype float32 --shared 240
"""

from __future__ import annotations

import argparse
import time

import common
import torch
from bench_vllm import LLAMA_100M

from prefixgym.engine.model import PRESETS, Transformer
from prefixgym.engine.model.packed import WeightPacker
from prefixgym.engine.sampler.kv_pool import DecodeView, DecodeWorkspace, KVPool
from prefixgym.engine.sampler.shared_keys import SharedPlan, SharedSegments

BS = 16


class _Row:  # a workspace row: anything a weak reference can point to
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama100m", help=f"{', '.join(PRESETS)} or llama100m")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--positions", type=int, default=320)
    parser.add_argument("--shared", type=int, default=112, help="shared positions (whole blocks)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    common.setup_threads(args.threads)
    print(common.machine_facts())
    config = LLAMA_100M if args.model == "llama100m" else PRESETS[args.model]
    dtype = getattr(torch, args.dtype)
    model = WeightPacker().pack(Transformer(config).to(dtype).eval(), shared=False)
    B, shared_blocks = args.rows, args.shared // BS
    nb = -(-(args.positions + 8 + args.steps) // BS)
    num_blocks = shared_blocks + B * (nb - shared_blocks) + 1
    pool = KVPool(config.n_layers, config.n_kv_heads, config.head_dim, num_blocks, BS, dtype,
                  torch.device("cpu"), attend_dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    own = nb - shared_blocks
    tables = [list(range(1, 1 + shared_blocks))
              + [1 + shared_blocks + b * own + j for j in range(own)] for b in range(B)]
    rows = [_Row() for _ in range(B)]
    positions = [args.positions + b % 7 for b in range(B)]
    tokens = torch.randint(0, config.vocab_size, (B, 1), generator=gen)

    def workspace(share: bool) -> DecodeWorkspace:
        plan = SharedPlan.of(tables, positions, BS) if share else SharedPlan.none(B)
        shared = SharedSegments(pool, plan, tables) if plan.segments else None
        return DecodeWorkspace(pool, rows, tables, plan.extent(positions), offsets=plan.offsets,
                               shared=shared)

    def step(ws: DecodeWorkspace) -> torch.Tensor:
        view = DecodeView(pool, ws, tables, positions)
        with torch.inference_mode():
            return model(tokens, view.positions_R_T, kv=view, last_only=True, check_inputs=False)

    print(f"{args.model} {args.dtype}: {B} rows at ~{args.positions} positions, "
          f"{shared_blocks * BS} shared; {args.steps} steps x {args.repeats} repeats", flush=True)
    best = {"every row's keys": float("inf"), "shared keys once": float("inf")}
    logits = {}
    for _ in range(args.repeats):
        for name in best:
            ws = workspace(share=name == "shared keys once")
            step(ws)  # (first call of a shape)
            start = time.perf_counter()
            for _ in range(args.steps):
                logits[name] = step(ws)
            best[name] = min(best[name], (time.perf_counter() - start) / args.steps * 1e3)
    plain, shared = best.values()
    diff = (logits["every row's keys"] - logits["shared keys once"]).abs().max().item()
    print(f"every row's keys {plain:.1f} ms, shared keys once {shared:.1f} ms a step: "
          f"{plain / shared:.2f}x; largest logit difference {diff:.2e}")


if __name__ == "__main__":
    main()
