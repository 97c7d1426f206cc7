"""Loading a checkpoint directory: prefixgym's own decoder vs transformers'
`AutoModelForCausalLM.from_pretrained`, both in fp32 on the CPU.

Usage: `python bench/bench_load.py --model DIR [--model DIR ...] [--repeats 3]
[--threads 2] [--first-on-machine] [--before DIR]`, e.g. `--model /tmp/real/smollm2
--model /tmp/real/gemma3` (docs/benchmarks.md, "Loading a checkpoint").

Each load runs in a fresh child process, transformers and prefixgym alternating (the
order rotates every repeat; with `--before DIR`, a third child loads with the
prefixgym/ package in DIR, an earlier commit's, in the same rotation), and the parent
reads every *.safetensors file of the directory before each child so all find it in
the OS file cache. A child imports its
library and `torch._dynamo` (both loads import it on first use: ~2 s here, the same
for both) before its clock starts, then loads once:
  - transformers: `from_pretrained(DIR, dtype=torch.float32)` (eval mode, ready for
    `generate`);
  - prefixgym: `load_model(DIR)` (the trainable decoder), then `EngineService(model)`
    (the sampler's copy, the KV pool); `service` is the sum;
  - then both take one greedy token of `PROMPT` (`first_token`, from the clock's start:
    what stands between a user's `--model DIR` and a first token). Version 0 shares the
    trainer's weights and packs its copy at its first forward, so that is where the
    packing falls (Gemma 3's 262k-token head is 671 MB of it). The packer's
    thread check of each weight shape runs once per machine and torch (packed.py keeps
    its answers in the cache directory); the children share this user's store, so
    after the first run they read it. `--first-on-machine` gives each prefixgym child
    an empty store instead: the first load on a machine.
Prints each repeat, then per model the medians and ratios to transformers' median.
Knows the two loaders; nothing of what they load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_facts, setup_threads

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
"""The prompt of the first token: one greedy token after the load (transformers: one
forward, what `generate` runs for it; prefixgym: a sample of one token)."""


def child(which: str, directory: str, threads: int) -> dict[str, float]:
    """One fresh process's import and load times (seconds)."""
    start = time.perf_counter()
    import torch
    import torch._dynamo  # noqa: F401 (both loads import it; kept off both clocks)

    setup_threads(threads)
    out: dict[str, float] = {}
    if which == "transformers":
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging
        logging.disable_progress_bar()
        out["import"] = time.perf_counter() - start
        clock = time.perf_counter()
        hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        out["load"] = time.perf_counter() - clock
        with torch.no_grad():
            hf_model(torch.tensor([PROMPT])).logits[0, -1].argmax()
        out["first_token"] = time.perf_counter() - clock
        return out
    from prefixgym.engine.model import load_model
    from prefixgym.engine.service import EngineService
    from prefixgym.types import SamplingParams
    out["import"] = time.perf_counter() - start
    clock = time.perf_counter()
    model = load_model(directory)
    out["load_model"] = time.perf_counter() - clock
    service = EngineService(model, device="cpu")
    out["service"] = time.perf_counter() - clock
    service.create_sampling_client().sample(
        PROMPT, 1, SamplingParams(max_tokens=1, temperature=0.0)).result()
    out["first_token"] = time.perf_counter() - clock
    service.close()
    return out


def read_files(directory: str) -> None:
    """Every *.safetensors file of `directory` read once: both loads find it cached."""
    for file in Path(directory).glob("*.safetensors"):
        with open(file, "rb") as f:
            while f.read(64 << 20):
                pass


def run_child(which: str, directory: str, threads: int, fresh_store: bool,
              before: str | None) -> dict[str, float]:
    read_files(directory)
    with tempfile.TemporaryDirectory() as store:
        env = dict(os.environ)
        if fresh_store:
            env["PREFIXGYM_CACHE_DIR"] = store
        if which == "before" and before is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [before, env.get("PYTHONPATH")]))
        done = subprocess.run(
            [sys.executable, __file__, "--child", "transformers" if which == "transformers"
             else "prefixgym", "--model", directory, "--threads", str(threads)],
            check=True, capture_output=True, text=True, env=env)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True,
                        help="a checkpoint directory (repeatable)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--first-on-machine", action="store_true",
                        help="each prefixgym child starts with an empty thread-check store")
    parser.add_argument("--before", default=None,
                        help="a directory holding another prefixgym/ (an earlier commit's) "
                             "to load with too, in the same rotation, as 'before'")
    parser.add_argument("--child", choices=("transformers", "prefixgym"), default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model[0], args.threads)))
        return
    print(machine_facts(), flush=True)
    kinds = ("transformers", "prefixgym") + (("before",) if args.before else ())
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        m: {kind: [] for kind in kinds} for m in args.model}
    for repeat in range(args.repeats):
        order = kinds[repeat % len(kinds):] + kinds[:repeat % len(kinds)]
        for directory in args.model:
            for which in order:
                times = run_child(which, directory, args.threads,
                                  args.first_on_machine and which != "transformers",
                                  args.before)
                results[directory][which].append(times)
                shown = ", ".join(f"{k} {v:.2f} s" for k, v in times.items())
                print(f"repeat {repeat + 1} {Path(directory).name} {which}: {shown}",
                      flush=True)
    for directory, runs in results.items():
        theirs = statistics.median(t["load"] for t in runs["transformers"])
        first = statistics.median(t["first_token"] for t in runs["transformers"])
        for kind in kinds[1:]:
            ours = {key: statistics.median(t[key] for t in runs[kind])
                    for key in ("load_model", "service", "first_token")}
            print(f"{Path(directory).name}: transformers {theirs:.2f} s; {kind} load_model "
                  f"{ours['load_model']:.2f} s ({ours['load_model'] / theirs:.2f}x), with the "
                  f"service {ours['service']:.2f} s ({ours['service'] / theirs:.2f}x); to a "
                  f"first token: transformers {first:.2f} s, {kind} "
                  f"{ours['first_token']:.2f} s ({ours['first_token'] / first:.2f}x) "
                  f"(medians of {args.repeats})", flush=True)


if __name__ == "__main__":
    main()
