"""Decode throughput: prefixgym's engine vs HF `generate`, and both vs the step's floor.

Both peers get the same weights, the same B random prompts (equal lengths, so HF needs
no padding) and sample exactly N new tokens each (temperature 1, no stop), at B = 1, 8,
64 and 128 rows by default. Decode tokens/s = B*(N-1) / (time for N tokens - time for
1 token), which takes the prefill and the first token out of both; a step's time is
that difference over N-1. Repetitions are interleaved. `--profile` runs cProfile on
one 64-sequence engine decode and prints the top functions.

`--dtypes bfloat16` runs the engine in bf16 against HF in every `--hf-dtypes` (default:
float32 and bfloat16), all on the same (bf16-rounded) weights; `--dtypes float32
bfloat16` gives both in one run (one table each), as `--presets tiny small` does.

The engine picks its own thread count per step (up to `--threads`, see
`prefixgym/engine/sampler/threads.py`). To be fair to HF, which does not, HF runs at every
count in `--hf-threads` (default: 1 and `--threads`) and each ratio is against HF's
best count for that dtype and batch; the per-count figures are printed too.

**The floor table** (`decode_floor.py` has the method): in each repeat, before the two
peers, the step's floor is measured at the same rows: the larger of (every linear of
the model at its real shape, (B, d_in) @ (d_in, d_out), summed over layers plus the
output head) and (the bytes a step must read -- all weights once, the K/V of every
row's average context, prompt + N/2 keys, in the engine's dtype -- over the read
bandwidth of a `torch.dot` over a buffer of that size). Both are timed on N-1 passes
in a row at each thread count the engine may pick, least wins. It excludes attention
scores, norms, RoPE, KV writes, sampling and Python overhead, so ours/floor and
HF/floor are above 1; below 1 means the floor is wrong. The **eager bound** adds
those ops back, each once per layer in its cheapest torch CPU kernel at the step's
shapes, timed the same way (`decode_floor.py`, part 3): eager/floor is the least
ratio any step built from torch's eager kernels can have, so a goal below it is out
of their reach at that row count. The **seq** columns (part 4) run those kernels
interleaved in the step's order, once as Python calls and once traced (no Python
between them): what the cheapest eager step costs with the caches as a real step
leaves them, with and without Python's dispatch.

    .venv/bin/python bench/bench_decode.py                 # tiny, fp32, N=64, 3 repeats
    .venv/bin/python bench/bench_decode.py --quick         # N=32, 1 repeat
    .venv/bin/python bench/bench_decode.py --presets tiny small --dtypes float32 bfloat16
    .venv/bin/python bench/bench_decode.py --profile [--dtypes bfloat16]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
from dataclasses import dataclass, field

import common
import torch
from decode_floor import DecodeFloor, FloorProbe

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


def profile(args: argparse.Namespace) -> None:
    """cProfile the engine thread over one 64-sequence decode of `args.new_tokens` tokens."""
    svc = LocalService(args.presets[0], seed=0, prefix_cache=False, dtype=args.dtypes[0])
    rows = prompts(64, args.prompt_len, svc.train_model.config.vocab_size)
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


@dataclass
class BatchResult:
    """Seconds per decode step of one batch size, one entry per repeat."""

    rows: int
    floors: list[DecodeFloor] = field(default_factory=list)
    ours: list[float] = field(default_factory=list)
    theirs: dict[tuple[str, int], list[float]] = field(default_factory=dict)

    def hf_best(self, name: str, hf_threads: list[int]) -> int:
        """HF's thread count with the least median step time for dtype `name`."""
        return min(hf_threads, key=lambda t: statistics.median(self.theirs[(name, t)]))


def measure_batch(svc: LocalService, hfs: dict, probe: FloorProbe, batch: int,
                  args: argparse.Namespace, hf_threads: list[int]) -> BatchResult:
    """Warm up, then `args.repeats` interleaved rounds of floor, engine and every HF peer."""
    N = args.new_tokens
    rows = prompts(batch, args.prompt_len, svc.train_model.config.vocab_size)
    engine_time(svc, rows, N)  # warm-up (the engine also settles its thread counts)
    for hf in hfs.values():
        for threads in hf_threads:
            hf_time(hf, rows, 2, threads)
    result = BatchResult(batch, theirs={(name, t): [] for name in hfs for t in hf_threads})
    keys = args.prompt_len + N // 2  # the decode steps attend to prompt+1 .. prompt+N-1 keys
    for _ in range(args.repeats):
        result.floors.append(probe.measure(batch, keys, passes=N - 1, sequence=True))
        result.ours.append((engine_time(svc, rows, N) - engine_time(svc, rows, 1)) / (N - 1))
        for (name, threads), values in result.theirs.items():
            hf = hfs[name]
            values.append((hf_time(hf, rows, N, threads) - hf_time(hf, rows, 1, threads)) / (N - 1))
    return result


def throughput_line(result: BatchResult, dtype: str, hf_threads: list[int]) -> str:
    """The 'B=...' line: tok/s of ours and of each HF peer, ratio vs HF's best count."""
    batch = result.rows
    line = f"B={batch:3d}  prefixgym[{dtype}] {common.spread([batch / s for s in result.ours], '{:.0f}')} tok/s"
    for name in sorted({name for name, _ in result.theirs}, reverse=True):
        best = result.hf_best(name, hf_threads)
        ratios = [b / a for a, b in zip(result.ours, result.theirs[(name, best)])]
        counts = ", ".join(f"{t}t {common.spread([batch / s for s in result.theirs[(name, t)]], '{:.0f}')}"
                           for t in hf_threads)
        line += f" | HF[{name}] ({counts}) tok/s, ratio vs {best}t {common.spread(ratios, '{:.2f}')}"
    return line


def floor_table(results: list[BatchResult], hf_names: list[str], hf_threads: list[int]) -> str:
    """Per batch size: the floor's two bounds, the floor, ours and HF's steps and their ratios."""
    med = statistics.median
    head = ("  rows | matmul ms (thr) | read MB / GB/s (thr) = ms | floor ms (bound) "
            "| ops ms (thr) | eager bound ms | eager/floor | seq ms py / traced "
            "| seq/floor py / traced | ours ms | ours/floor")
    head += "".join(f" | HF[{name}] ms (thr) | HF/floor" for name in hf_names)
    lines = [head]
    for r in results:
        fl = r.floors
        bound = max(("matmul", "memory"), key=lambda b: sum(f.bound == b for f in fl))
        line = (f"  {r.rows:4d} | {med([f.matmul_s for f in fl]) * 1e3:.3f} ({fl[0].matmul_threads}) "
                f"| {fl[0].read_bytes / 1e6:.1f} / {med([f.bandwidth_Bps for f in fl]) / 1e9:.1f} "
                f"({fl[0].bandwidth_threads}) = {med([f.memory_s for f in fl]) * 1e3:.3f} "
                f"| {med([f.seconds for f in fl]) * 1e3:.3f} ({bound}) "
                f"| {med([f.ops_s for f in fl]) * 1e3:.3f} ({fl[0].ops_threads}) "
                f"| {med([f.eager_s for f in fl]) * 1e3:.3f} "
                f"| {common.spread([f.eager_s / f.seconds for f in fl], '{:.2f}')} "
                f"| {med([f.sequence_s for f in fl]) * 1e3:.3f} / "
                f"{med([f.traced_s for f in fl]) * 1e3:.3f} "
                f"| {common.spread([f.sequence_s / f.seconds for f in fl], '{:.2f}')} / "
                f"{common.spread([f.traced_s / f.seconds for f in fl], '{:.2f}')} "
                f"| {med(r.ours) * 1e3:.3f} "
                f"| {common.spread([o / f.seconds for o, f in zip(r.ours, fl)], '{:.2f}')}")
        for name in hf_names:
            best = r.hf_best(name, hf_threads)
            steps = r.theirs[(name, best)]
            line += (f" | {med(steps) * 1e3:.3f} ({best}) "
                     f"| {common.spread([h / f.seconds for h, f in zip(steps, fl)], '{:.2f}')}")
        lines.append(line)
    return "\n".join(lines)


def run(preset: str, dtype: str, args: argparse.Namespace) -> None:
    """One preset in one engine dtype: the 'B=' lines, then the floor table."""
    # no prefix cache: every repeat decodes from scratch, nothing is reused
    svc = LocalService(preset, seed=0, prefix_cache=False, dtype=dtype)
    hf_dtypes = args.hf_dtypes or sorted({dtype, "float32"}, reverse=True)
    hf_threads = args.hf_threads or sorted({1, args.threads})
    hfs = {}
    for name in hf_dtypes:  # same weights, cast: bf16-rounded values when the engine is bf16
        hfs[name] = common.hf_llama_from(svc.train_model).to(getattr(torch, name))
        hfs[name].generation_config.eos_token_id = None
    tuner = svc.engine.threads  # the floor is timed at the counts the engine may choose
    probe = FloorProbe(svc.train_model, getattr(torch, dtype), tuner.candidates,
                       tuner.explore_below)
    N = args.new_tokens
    print(f"preset={preset} dtype={dtype} hf={hf_dtypes} hf_threads={hf_threads} "
          f"prompt={args.prompt_len} new_tokens={N}")
    results = []
    for batch in args.batches:
        results.append(measure_batch(svc, hfs, probe, batch, args, hf_threads))
        print(throughput_line(results[-1], dtype, hf_threads), flush=True)
    print(f"engine thread choices: {svc.engine.threads.best()}")
    print(f"[{preset} {dtype}] decode step floor = max(matmul, bytes read / bandwidth); eager "
          f"bound = max(matmul + the other ops' cheapest eager kernels, read); "
          f"{args.prompt_len + N // 2} keys per row on average; ms per step, median of "
          f"{args.repeats}; ratios per repeat; (thr) = thread count of the least time")
    print(floor_table(results, hf_dtypes, hf_threads), flush=True)
    svc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", "--presets", dest="presets", nargs="+", default=["tiny"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 128])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", "--dtypes", dest="dtypes", nargs="+", default=["float32"],
                        choices=["float32", "bfloat16"], help="engine dtypes, one table each")
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
    if args.new_tokens < 2 or args.repeats < 1 or min(args.batches) < 1:
        parser.error("--new-tokens must be at least 2, --repeats and every batch at least 1")
    common.setup_threads(args.threads)
    print(common.machine_facts())
    if args.profile:
        profile(args)
        return
    for preset in args.presets:
        for dtype in args.dtypes:
            run(preset, dtype, args)


if __name__ == "__main__":
    main()
