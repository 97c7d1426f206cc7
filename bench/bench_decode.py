"""Decode throughput: prefixgym's engine vs HF `generate`, 1, 8 and 64 sequences at once.

Both peers get the same weights, the same B random prompts (equal lengths, so HF needs
no padding) and sample exactly N new tokens each (temperature 1, no stop). Decode
tokens/s = B*(N-1) / (time for N tokens - time for 1 token), which takes the prefill
and the first token out of both. Repetitions are interleaved. `--profile` runs
cProfile on one 64-sequence engine decode and prints the top functions.

`--dtype bfloat16` runs the engine in bf16 against HF in every `--hf-dtypes` (default:
float32 and bfloat16), all on the same (bf16-rounded) weights.

The engine picks its own thread count per step (up to `--threads`, see
`prefixgym/engine/threads.py`). To be fair to HF, which does not, HF runs at every
count in `--hf-threads` (default: 1 and `--threads`) and each ratio is against HF's
best count for that dtype and batch; the per-count figures are printed too.

    .venv/bin/python bench/bench_decode.py                 # tiny, N=64, 3 repeats
    .venv/bin/python bench/bench_decode.py --quick         # N=32, 1 repeat
    .venv/bin/python bench/bench_decode.py --dtype bfloat16
    .venv/bin/python bench/bench_decode.py --profile [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import common
import torch

from prefixgym.local_service import LocalService
from prefixgym.types import SamplingParams


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(1, vocab, (batch, length), generator=gen).tolist()


def engine_time(svc: LocalService, rows: list[list[int]], new_tokens: int) -> float:
    sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0)

    def go() -> None:
        futures = [sampler.sample(r, sampling_params=params) for r in rows]
        for f in futures:
            f.result()

    return common.timed(go)[0]


def hf_time(hf, rows: list[list[int]], new_tokens: int, threads: int) -> float:
    ids = torch.tensor(rows)

    def go() -> None:
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                        temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                        pad_token_id=0)

    with common.num_threads(threads):
        return common.timed(go)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hf-dtypes", nargs="+", choices=["float32", "bfloat16"], default=None,
                        help="HF peers (default: the engine's dtype, plus float32 for bf16)")
    parser.add_argument("--quick", action="store_true", help="N=32, 1 repeat")
    parser.add_argument("--profile", action="store_true", help="cProfile a 64-sequence decode")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hf-threads", type=int, nargs="+", default=None,
                        help="thread counts HF runs at (default: 1 and --threads)")
    args = parser.parse_args()
    if args.quick:
        args.new_tokens, args.repeats = 32, 1
    common.setup_threads(args.threads)
    print(common.machine_facts())
    # no prefix cache: every repeat decodes from scratch, nothing is reused
    svc = LocalService(args.preset, seed=0, prefix_cache=False, dtype=args.dtype)
    vocab = svc.train_model.config.vocab_size
    if args.profile:
        rows = prompts(64, args.prompt_len, vocab)
        engine_time(svc, rows, 4)
        profiler = cProfile.Profile()
        step = svc.engine.step

        def profiled_step():  # cProfile is per thread: enable it in the engine thread
            profiler.enable()
            try:
                step()
            finally:
                profiler.disable()

        svc.engine.step = profiled_step  # type: ignore[method-assign]
        seconds = engine_time(svc, rows, args.new_tokens)
        print(f"64 x {args.new_tokens} tokens in {seconds:.3f} s (profiled)")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(22)
        svc.close()
        return
    hf_dtypes = args.hf_dtypes or sorted({args.dtype, "float32"}, reverse=True)
    hf_threads = args.hf_threads or sorted({1, args.threads})
    hfs = {}
    for name in hf_dtypes:  # same weights, cast: bf16-rounded values when the engine is bf16
        hfs[name] = common.hf_llama_from(svc.train_model).to(getattr(torch, name))
        hfs[name].generation_config.eos_token_id = None
    N = args.new_tokens
    print(f"preset={args.preset} dtype={args.dtype} hf={hf_dtypes} hf_threads={hf_threads} "
          f"prompt={args.prompt_len} new_tokens={N}")
    for batch in args.batches:
        rows = prompts(batch, args.prompt_len, vocab)
        engine_time(svc, rows, N)  # warm-up (the engine also settles its thread counts)
        for hf in hfs.values():
            for threads in hf_threads:
                hf_time(hf, rows, 2, threads)
        ours: list[float] = []
        theirs = {(name, t): [] for name in hfs for t in hf_threads}
        for _ in range(args.repeats):
            ours.append(batch * (N - 1) / (engine_time(svc, rows, N) - engine_time(svc, rows, 1)))
            for (name, threads), values in theirs.items():
                hf = hfs[name]
                values.append(batch * (N - 1) / (hf_time(hf, rows, N, threads)
                                                 - hf_time(hf, rows, 1, threads)))
        line = f"B={batch:3d}  prefixgym[{args.dtype}] {common.spread(ours, '{:.0f}')} tok/s"
        for name in hfs:
            per_count = {t: theirs[(name, t)] for t in hf_threads}
            best = max(per_count, key=lambda t: sorted(per_count[t])[len(per_count[t]) // 2])
            ratios = [a / b for a, b in zip(ours, per_count[best])]
            counts = ", ".join(f"{t}t {common.spread(v, '{:.0f}')}" for t, v in per_count.items())
            line += (f" | HF[{name}] ({counts}) tok/s, ratio vs {best}t "
                     f"{common.spread(ratios, '{:.2f}')}")
        print(line, flush=True)
    print(f"engine thread choices: {svc.engine.threads.best()}")
    svc.close()


if __name__ == "__main__":
    main()
