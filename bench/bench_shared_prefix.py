"""Training with shared prefixes vs without, on the same weights and datums, one run.

Parts (`--part`, default all three):

  long    the long-prefix GRPO batch: system prompt + tool definitions of 1,000 tokens
          shared by every episode; B groups (`--groups`) of G = 8 episodes, each group
          with its own 30-token first user message; two turns per episode: reply (50
          tokens), env message (20), reply (50). 1,150 tokens, 1,149 inputs per datum;
          weight 1 on the replies' tokens, loss importance_sampling, advantages / loss
          tokens. Contenders: `TrainerOptions(share_prefixes=True)` and `(False)` on two
          copies of one model; each round is one update (forward_backward + optim_step)
          of each, interleaved ABBA; the first round is a warm-up. Printed: train tokens
          computed, update seconds (median, min), the ratios.
  memory  peak memory of one forward_backward, shared vs unshared, on the long batch and
          on a batch shaped like the default GRPO step (16 groups x 8 episodes of a
          40-token system prompt, a 20-token first user message per group, one to four
          turns of an 8-token reply and a 10-token env message). Each contender runs in
          a fresh subprocess that, once model and datums are built, resets its peak RSS
          (`echo 5 > /proc/self/clear_refs`), reads VmRSS, runs the call, and reads the
          peak (VmHWM); printed: peak - before, MiB. Same model, datums and budget.
  drift   the long batch (`--groups 1`) under bf16 autocast: shared vs unshared, and
          unshared bf16 vs fp32: target logprobs (max, mean |diff|), gradients (max
          |diff| relative to the largest entry, over parameters).

Token ids are random (the compute does not depend on them); `tiny` preset by default.

    .venv/bin/python bench/bench_shared_prefix.py                   # all parts, B=2
    .venv/bin/python bench/bench_shared_prefix.py --part long --groups 4 --rounds 4

Knows the training client and model; not envs or samplers.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import common  # sets OMP_WAIT_POLICY=PASSIVE before torch starts its threads
import torch

from prefixgym.engine.model import load_model
from prefixgym.engine.trainer.options import TrainerOptions
from prefixgym.engine.trainer.training import TrainingClient
from prefixgym.types import AdamParams, Datum, ModelInput

VOCAB = 4096


def _ids(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=gen).tolist()


def _datum(pieces: list[tuple[list[int], bool]], batch_loss_tokens: int,
           gen: torch.Generator) -> Datum:
    """Inputs tokens[:-1], targets tokens[1:]; weight 1 where the target was sampled."""
    tokens = [t for ids, _ in pieces for t in ids]
    sampled = [s for ids, s in pieces for _ in ids]
    weights = [1.0 if s else 0.0 for s in sampled[1:]]
    advantage = float(torch.randn(1, generator=gen))
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": weights,
            "logprobs": [-2.0] * len(weights),
            "advantages": [advantage * w / batch_loss_tokens for w in weights],
        },
    )


def long_batch(groups: int, seed: int = 0) -> list[Datum]:
    """The long-prefix workload (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    system = _ids(gen, 1000)
    loss_tokens = groups * 8 * 100
    datums = []
    for _ in range(groups):
        user = _ids(gen, 30)
        for _ in range(8):
            datums.append(_datum([(system, False), (user, False), (_ids(gen, 50), True),
                                  (_ids(gen, 20), False), (_ids(gen, 50), True)],
                                 loss_tokens, gen))
    return datums


def grpo_shaped_batch(seed: int = 0) -> list[Datum]:
    """16 groups x 8 episodes shaped like the default GRPO step (see the docstring)."""
    gen = torch.Generator().manual_seed(seed)
    system = _ids(gen, 40)
    datums = []
    for _ in range(16):
        user = _ids(gen, 20)
        for _ in range(8):
            pieces = [(system, False), (user, False)]
            for _ in range(int(torch.randint(1, 5, (1,), generator=gen))):
                pieces += [(_ids(gen, 8), True), (_ids(gen, 10), False)]
            datums.append(_datum(pieces[:-1], 16 * 8 * 20, gen))
    return datums


def part_long(args: argparse.Namespace) -> None:
    datums = long_batch(args.groups)
    clients = {share: TrainingClient(load_model(args.preset, seed=0),
                                     TrainerOptions(share_prefixes=share))
               for share in (True, False)}
    seconds: dict[bool, list[float]] = {True: [], False: []}
    computed: dict[bool, int] = {}
    adam = AdamParams(learning_rate=1e-4)
    for r in range(args.rounds + 1):
        for share in ((True, False) if r % 2 == 0 else (False, True)):
            client = clients[share]
            start = time.perf_counter()
            out = client.forward_backward(datums, "importance_sampling").result()
            client.optim_step(adam).result()
            if r > 0:  # round 0 is the warm-up
                seconds[share].append(time.perf_counter() - start)
            computed[share] = out.usage.train_computed_tokens
    print(f"long prefix: {args.groups} groups x 8 episodes, {len(datums)} datums of "
          f"{datums[0].model_input.length} inputs, preset {args.preset}, {args.rounds} rounds")
    print("| contender | train computed | update s, median (min-max) | min |")
    print("|---|---:|---:|---:|")
    for share, name in ((True, "shared prefixes"), (False, "unshared")):
        print(f"| {name} | {computed[share]:,} | {common.spread(seconds[share], '{:.2f}')} | "
              f"{min(seconds[share]):.2f} |")
    print(f"computed: {computed[False] / computed[True]:.2f}x fewer; update: "
          f"{statistics.median(seconds[False]) / statistics.median(seconds[True]):.2f}x faster "
          f"(median), {min(seconds[False]) / min(seconds[True]):.2f}x (min)")


def _peak_child(workload: str, share: bool, groups: int, preset: str) -> None:
    """Run in a fresh process: one forward_backward; print peak RSS growth in MiB."""
    datums = long_batch(groups) if workload == "long" else grpo_shaped_batch()
    client = TrainingClient(load_model(preset, seed=0), TrainerOptions(share_prefixes=share))
    with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) restarts from here
        f.write("5")
    before_kib = _status_kib("VmRSS")
    out = client.forward_backward(datums, "importance_sampling").result()
    print((_status_kib("VmHWM") - before_kib) / 1024, out.usage.train_computed_tokens,
          out.usage.train_tokens)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def part_memory(args: argparse.Namespace) -> None:
    print("| batch | contender | train computed | peak RSS - RSS before, MiB |")
    print("|---|---|---:|---:|")
    for workload in ("long", "grpo-shaped"):
        for share in (True, False):
            cmd = [sys.executable, __file__, "--child", workload, str(int(share)),
                   "--groups", str(args.groups), "--preset", args.preset]
            mib, computed, _ = subprocess.run(cmd, capture_output=True, text=True,
                                              check=True).stdout.split()
            name = "shared prefixes" if share else "unshared"
            print(f"| {workload} | {name} | {int(computed):,} | {float(mib):.0f} |")


def part_drift(args: argparse.Namespace) -> None:
    datums = long_batch(1)
    model = load_model(args.preset, seed=0)
    results = {}
    for dtype, share in ((torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, False)):
        client = TrainingClient(model, TrainerOptions(compute_dtype=dtype, share_prefixes=share))
        out = client.forward_backward(datums, "importance_sampling").result()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        logprobs = torch.tensor([x for o in out.loss_fn_outputs for x in o["logprobs"]])
        results[dtype, share] = (logprobs, grads)
    print("| compared | logprobs max |diff| | mean | grad max |diff| / max |g| |")
    print("|---|---:|---:|---:|")
    pairs = (("bf16 shared vs bf16 unshared", (torch.bfloat16, True), (torch.bfloat16, False)),
             ("bf16 unshared vs fp32 unshared", (torch.bfloat16, False), (torch.float32, False)))
    for name, a, b in pairs:
        (lp_a, g_a), (lp_b, g_b) = results[a], results[b]
        diff = (lp_a - lp_b).abs()
        grad = max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(g_a, g_b))
        print(f"| {name} | {float(diff.max()):.2g} | {float(diff.mean()):.2g} | {grad:.2g} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "long", "memory", "drift"), default="all")
    parser.add_argument("--groups", type=int, default=2, help="groups of 8 in the long batch")
    parser.add_argument("--rounds", type=int, default=3, help="timed updates per contender")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    common.setup_threads(2)
    if args.child:
        _peak_child(args.child[0], args.child[1] == "1", args.groups, args.preset)
        return
    print(common.machine_facts())
    if args.part in ("all", "long"):
        part_long(args)
    if args.part in ("all", "memory"):
        part_memory(args)
    if args.part in ("all", "drift"):
        part_drift(args)
    print(common.machine_facts())


if __name__ == "__main__":
    main()
