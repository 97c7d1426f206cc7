"""A warm start on recorded runs: the sequences `prefixgym proxy --record` wrote.

Each line of the file is one sequence: its `tokens`, which of them were sampled
(`sampled_mask`) and its `turns` (`reply_start`, `reply_end`); an expert's runs of an agent
program, recorded through the proxy in front of a stronger model, or any file of that
shape. `read_records` checks every line against the model that will train on it (token ids
inside its vocabulary: ids recorded with another tokenizer mean nothing to this one) and
keeps each as a `Trajectory`; `record_batches` gives the warm start its step's datums: the
records in one order fixed by the run's seed, `per_step` a step, cross-entropy on the
sampled tokens. Knows trajectories, datums and files; not how the records were made.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from prefixgym.files import read_jsonl
from prefixgym.rollouts.types import Trajectory, Turn
from prefixgym.trainer.datum import num_loss_tokens, sft_datum, trainable
from prefixgym.types import Datum


def read_records(path: str, vocab_size: int) -> list[Trajectory]:
    """The trainable sequences of a record file; ValueError naming the line at fault."""
    out = []
    for number, record in read_jsonl(path, "--sft-data"):
        where = f"--sft-data {path}:{number}"
        try:
            tokens, mask = list(record["tokens"]), list(record["sampled_mask"])
            turns = [Turn(int(t["reply_start"]), int(t["reply_end"]), str(t.get("stop_reason", "")))
                     for t in record["turns"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: not a recorded sequence ({type(e).__name__}: {e}); "
                             "want tokens, sampled_mask and turns, as prefixgym proxy "
                             "--record writes") from None
        bad = next((t for t in tokens if not isinstance(t, int) or not 0 <= t < vocab_size), None)
        if bad is not None or len(mask) != len(tokens):
            raise ValueError(f"{where}: " + (
                f"token id {bad!r} is outside this model's vocabulary [0, {vocab_size}): "
                "recorded with another tokenizer?" if bad is not None else
                f"{len(mask)} mask entries for {len(tokens)} tokens"))
        trajectory = Trajectory(episode_id=f"record{number}", group_id="records", seed=0,
                                turns=turns, tokens=tokens,
                                sampled_mask=[bool(m) for m in mask],
                                logprobs=[0.0] * len(tokens))
        if trainable(trajectory):
            out.append(trajectory)
    if not out:
        raise ValueError(f"--sft-data {path}: no recorded sequence with a sampled token")
    return out


def record_batches(records: Sequence[Trajectory], per_step: int, seed: int
                   ) -> Callable[[int], list[Datum]]:
    """Step -> its datums: passes over the records in one seeded order, `per_step` a step,
    weights summing to 1 over the step's sampled tokens."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)

    def batch(step: int) -> list[Datum]:
        chosen = [records[order[(step * per_step + i) % len(order)]] for i in range(per_step)]
        n_loss = num_loss_tokens(chosen)
        return [sft_datum(t, n_loss) for t in chosen]

    return batch
