"""Can the model learn to copy tokens from its context, and how fast? SFT through the
training client, teacher-forced accuracy of the copied tokens.

Usage: `python bench/copy_probe.py [--task copy|arithmetic] [--prefix 0] [--steps 300]
[--no-system] [--model tiny] [--lr 2e-3] [--const-lr] [--per-step 16] [--every 25]`

`--task copy`: each sequence is `<bos> filler x1..xk <sep> x1..xk <eos>` with k in
3..6 and the x drawn from 20 token ids (the 20 operands of Arithmetic); the loss is
on the copy and the end token only. `--prefix N` puts the same N random filler tokens
(a stand-in for a fixed system prompt) before every task. `--task arithmetic`: the
warm start's own data (Arithmetic's expert, always calling the calculator,
2 operands); `--no-system` cuts each episode's system turn (the tool schema) out of
the context. Every `--every` steps it prints the held-out copied tokens' mean NLL
and the share with p > 0.5 (the target is the greedy token); for arithmetic also the
other reply tokens' NLL. Same lr schedule as the warm start (warm-up + cosine)
unless `--const-lr`. Figures: docs/benchmarks.md, "Copying from the context".
Knows the training protocol and Arithmetic's expert; not sampling or GRPO.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable

import prefixgym as pg
from prefixgym.envs.registration import make_agent_env
from prefixgym.trainer.schedule import warmup_cosine_lr
from prefixgym.trainer.sft import SFT_SEED_BASE, expert_datums
from prefixgym.types import AdamParams, Datum, ModelInput

BOS, SEP, EOS = 1, 2, 3
ALPHABET = list(range(1000, 1020))


def copy_batch(rng: random.Random, n: int, filler: list[int]) -> list[Datum]:
    """n copy sequences; weights sum to 1 over the batch's copied tokens."""
    rows = []
    for _ in range(n):
        items = [rng.choice(ALPHABET) for _ in range(rng.randint(3, 6))]
        tokens = [BOS, *filler, *items, SEP, *items, EOS]
        n_loss = len(items) + 1
        rows.append((tokens, [0.0] * (len(tokens) - 1 - n_loss) + [1.0] * n_loss))
    total = sum(sum(w) for _, w in rows)
    return [Datum(model_input=ModelInput.from_ints(t[:-1]),
                  loss_fn_inputs={"target_tokens": t[1:], "weights": [x / total for x in w]})
            for t, w in rows]


def without_system(datums: list[Datum], im_start: int) -> list[Datum]:
    """Each datum from its second `<|im_start|>` (the user turn) on."""
    out = []
    for d in datums:
        tokens = d.model_input.to_ints()
        start = tokens.index(im_start, 1)
        out.append(Datum(model_input=ModelInput.from_ints(tokens[start:]),
                         loss_fn_inputs={k: list(v)[start:] for k, v in d.loss_fn_inputs.items()}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=("copy", "arithmetic"), default="copy")
    parser.add_argument("--prefix", type=int, default=0, help="copy: filler tokens before it")
    parser.add_argument("--no-system", action="store_true", help="arithmetic: cut the system turn")
    parser.add_argument("--env-kwargs", default='{"num_operands": 2}',
                        help='arithmetic: JSON env kwargs (the expert always calls), e.g. '
                        '\'{"num_operands": 2, "tool_schemas": false}\'')
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--per-step", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--const-lr", action="store_true")
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    service = pg.LocalService(model=args.model, seed=args.seed, num_threads=args.threads,
                              thread_tuning=False)
    tokenizer, training = service.tokenizer, service.create_training_client()

    # 1. the task: a batch maker, held-out datums, and which loss tokens are copies
    batch: Callable[[int], list[Datum]]
    if args.task == "copy":
        filler = [random.Random(123).randrange(500, 4000) for _ in range(args.prefix)]
        rng = random.Random(args.seed)
        batch = lambda step: copy_batch(rng, args.per_step, filler)  # noqa: E731
        held = copy_batch(random.Random(999), 64, filler)
        is_copy: Callable[[int], bool] = lambda token: True  # noqa: E731
    else:
        env_kwargs = {"max_turns": 3, **json.loads(args.env_kwargs), "expert_tool_rate": 1.0}
        envs = [make_agent_env("prefixgym/Arithmetic-v0", env_kwargs) for _ in range(16)]
        im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        cut = (lambda ds: without_system(ds, im_start)) if args.no_system else (lambda ds: ds)

        def batch(step: int) -> list[Datum]:
            seeds = [SFT_SEED_BASE + step * args.per_step + i for i in range(args.per_step)]
            return cut(expert_datums(envs, tokenizer, seeds))

        held = cut(expert_datums(envs, tokenizer, list(range(5_000_000, 5_000_016))))

        def is_copy(token: int) -> bool:  # digits and operators: copied from the question
            piece = tokenizer.decode([token]).strip()
            return piece != "" and all(c in "0123456789+-*" for c in piece)

    # 2. train, probing the held-out datums every `--every` steps
    start = time.perf_counter()

    def probe(step: int) -> None:
        out = training.forward(held, loss_fn="cross_entropy").result()
        copied: list[float] = []
        other: list[float] = []
        for datum, result in zip(held, out.loss_fn_outputs):
            for t, w, lp in zip(datum.loss_fn_inputs["target_tokens"],
                                datum.loss_fn_inputs["weights"], result["logprobs"]):
                if w > 0:
                    (copied if is_copy(int(t)) else other).append(lp)
        line = (f"step {step:4d}  copied tokens: nll {-sum(copied) / len(copied):.3f}, "
                f"p>0.5 {sum(lp > math.log(0.5) for lp in copied) / len(copied):.2f}")
        if other:
            line += f"  other reply tokens: nll {-sum(other) / len(other):.3f}"
        print(f"{line}  ({time.perf_counter() - start:.0f} s)", flush=True)

    print(vars(args), f"context {len(held[0].model_input.to_ints())} tokens", flush=True)
    probe(0)
    for step in range(args.steps):
        training.forward_backward(batch(step), loss_fn="cross_entropy").result()
        lr = args.lr if args.const_lr else warmup_cosine_lr(step, args.steps, args.lr)
        training.optim_step(AdamParams(learning_rate=lr, grad_clip_norm=1.0)).result()
        if (step + 1) % args.every == 0:
            probe(step + 1)


if __name__ == "__main__":
    main()
