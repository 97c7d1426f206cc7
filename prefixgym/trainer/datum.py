"""Trajectories -> Datums: one merged training sequence per episode.

An episode's turns normally form one growing token sequence: each prompt extends the
previous prompt plus the sampled reply. Merging them into one `Datum` trains the
whole episode in one forward pass, computing every position once. Weights are 1
exactly on sampled tokens and 0 elsewhere; the sampler's logprobs and the episode's
advantage sit on the sampled positions. Where a prompt does not extend the sequence
so far (history was edited), the datum is split there and the split is counted.

This module knows token ids and advantages; not envs, tokenizers or models.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixgym.rollouts.types import Trajectory
from prefixgym.types import Datum, ModelInput


@dataclass
class _Sequence:
    tokens: list[int]
    sampled_mask: list[bool]
    logprobs: list[float]


@dataclass
class AssembledDatums:
    datums: list[Datum]
    num_splits: int


def merge_turns(trajectory: Trajectory) -> tuple[list[_Sequence], int]:
    """Turns -> maximal sequences in which each prompt extends what came before."""
    sequences: list[_Sequence] = []
    current: _Sequence | None = None
    splits = 0
    for turn in trajectory.turns:
        prompt = turn.prompt_tokens
        if current is not None and prompt[: len(current.tokens)] == current.tokens:
            extra = prompt[len(current.tokens) :]
            current.tokens += extra
            current.sampled_mask += [False] * len(extra)
            current.logprobs += [0.0] * len(extra)
        else:
            if current is not None:
                sequences.append(current)
                splits += 1
            current = _Sequence(list(prompt), [False] * len(prompt), [0.0] * len(prompt))
        current.tokens += turn.sampled_tokens
        current.sampled_mask += [True] * len(turn.sampled_tokens)
        current.logprobs += list(turn.sampled_logprobs)
    if current is not None:
        sequences.append(current)
    return sequences, splits


def trajectory_to_datums(trajectory: Trajectory, advantage: float) -> AssembledDatums:
    """One Datum per merged sequence: inputs tokens[:-1], targets tokens[1:].

    Position i predicts token i+1, so its weight is 1 when token i+1 was sampled.
    """
    sequences, splits = merge_turns(trajectory)
    datums = []
    for seq in sequences:
        if len(seq.tokens) < 2 or not any(seq.sampled_mask):
            continue
        weights = [1.0 if m else 0.0 for m in seq.sampled_mask[1:]]
        datums.append(
            Datum(
                model_input=ModelInput.from_ints(seq.tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": seq.tokens[1:],
                    "weights": weights,
                    "logprobs": seq.logprobs[1:],
                    "advantages": [advantage * w for w in weights],
                },
            )
        )
    return AssembledDatums(datums, splits)
