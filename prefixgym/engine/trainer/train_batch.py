"""Turn a forward_backward request's datums into padded (B, T) tensor chunks.

1) `prepare_request` checks a whole request before any compute: the loss name and
   config, then each datum by `prepare_datum`, which checks one `Datum` against the
   model and the loss's needs (model_input tokens and target ids inside the
   vocabulary, no longer than max_seq_len, known and required `loss_fn_inputs` keys),
   re-runs the datum's own checks (`types.check_loss_fn_inputs`: one finite value per
   position), and returns it as 1-D CPU tensors, with weights defaulting to 1 and its
   loss positions (`types.loss_positions`) as the input "loss_mask". A problem raises
   ValueError naming the datum index and key.
2) `make_chunks` groups consecutive datums so that B x T_max <= max_tokens (the plain
   path); `make_shared_chunks` takes the groups of a prefix-trie plan
   (`prefix_trie.plan_chunks`). Both right-pad each group with `pad_chunk`: zeros, so
   padded positions get weight 0, moved to a device.

This module knows nothing of models, gradients or optimizers; of losses it knows only
which input keys they read (`losses.LossSpec`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from prefixgym.engine.trainer import losses
from prefixgym.engine.trainer.prefix_trie import TriePlan, plan_chunks
from prefixgym.types import Datum, check_loss_fn_inputs, loss_positions

__all__ = [
    "Chunk", "PreparedDatum", "make_chunks", "make_shared_chunks", "pad_chunk", "prepare_datum",
    "prepare_request",
]

Tensor = torch.Tensor


@dataclass
class PreparedDatum:
    """One validated datum as 1-D CPU tensors of length n."""

    tokens_T: Tensor  # int64
    inputs: dict[str, Tensor]  # target_tokens (int64); weights, logprobs, ..., loss_mask (float64)
    num_loss_tokens: int  # its loss positions (see types.loss_positions)

    @property
    def length(self) -> int:
        return int(self.tokens_T.shape[0])


def _as_1d(where: str, values: object) -> Tensor:
    try:
        if isinstance(values, Tensor):
            out = values.detach().to("cpu", torch.float64)
        else:
            out = torch.as_tensor(values, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{where} is not a list of numbers: {e}") from None
    if out.dim() != 1:
        raise ValueError(f"{where} must be a flat list of numbers, got shape {tuple(out.shape)}")
    return out


def _token_ids(where: str, values: object, vocab_size: int) -> Tensor:
    ids = _as_1d(where, values)
    bad = (~torch.isfinite(ids)) | (ids != ids.round()) | (ids < 0) | (ids >= vocab_size)
    if bad.any():
        j = int(bad.nonzero()[0])
        raise ValueError(
            f"{where}[{j}] = {ids[j].item():g} is not a token id of this model "
            f"(integers in [0, {vocab_size}))"
        )
    return ids.long()


def prepare_request(
    datums: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None,
    vocab_size: int, max_seq_len: int, any_keys: bool = False,
) -> tuple[list[PreparedDatum], losses.LossSpec, dict[str, float]]:
    """Step 1 for a whole request: the loss and its config, then every datum
    (`prepare_datum`); ValueError names the first problem. Returns the prepared
    datums, the loss's spec and its config with defaults filled in."""
    spec = losses.get_loss(loss_fn)
    config = losses.validate_config(loss_fn, loss_fn_config)
    if isinstance(datums, (str, bytes)) or not isinstance(datums, Sequence):
        raise ValueError(  # noqa: TRY004 - bad input is a ValueError throughout prefixgym
            f"datums must be a list of Datum, got {type(datums).__name__}"
        )
    if len(datums) == 0:
        raise ValueError("datums is empty; forward_backward needs at least one Datum")
    prepared = [prepare_datum(i, d, spec, loss_fn, vocab_size, max_seq_len, any_keys)
                for i, d in enumerate(datums)]
    return prepared, spec, config


def prepare_datum(
    i: int, datum: Datum, spec: losses.LossSpec, loss_fn: str, vocab_size: int, max_seq_len: int,
    any_keys: bool = False,
) -> PreparedDatum:
    """Validate datum `i` for `loss_fn` and turn it into tensors; ValueError names the problem.
    `any_keys` lets through keys no built-in loss reads (a custom loss's); they are not
    converted."""
    tokens = getattr(getattr(datum, "model_input", None), "tokens", None)
    if tokens is None:
        raise ValueError(f"datums[{i}] has no model_input.tokens (got {type(datum).__name__})")
    tokens_T = _token_ids(f"datums[{i}].model_input.tokens", tokens, vocab_size)
    n = int(tokens_T.shape[0])
    if n == 0:
        raise ValueError(f"datums[{i}].model_input.tokens is empty")
    if n > max_seq_len:
        raise ValueError(
            f"datums[{i}] has {n} tokens, more than the model's max_seq_len {max_seq_len}"
        )
    loss_fn_inputs = getattr(datum, "loss_fn_inputs", None)
    if not isinstance(loss_fn_inputs, Mapping):
        raise ValueError(  # noqa: TRY004 - bad input is a ValueError throughout prefixgym
            f"datums[{i}].loss_fn_inputs must be a dict, got {type(loss_fn_inputs).__name__}"
        )
    unknown = sorted(set(loss_fn_inputs) - losses.KNOWN_INPUT_KEYS)
    if unknown and not any_keys:
        raise ValueError(
            f"datums[{i}].loss_fn_inputs has unknown key(s) {unknown}; known keys are "
            f"{sorted(losses.KNOWN_INPUT_KEYS)}"
        )
    for key in spec.required:
        if key not in loss_fn_inputs:
            raise ValueError(
                f"datums[{i}].loss_fn_inputs is missing {key!r}, which loss_fn "
                f"{loss_fn!r} needs (it needs {list(spec.required)})"
            )
    inputs = {
        key: _as_1d(f"datums[{i}].loss_fn_inputs[{key!r}]", loss_fn_inputs[key])
        for key in (*spec.required, *spec.optional) if key in loss_fn_inputs
    }
    lists = {k: v.tolist() for k, v in inputs.items()}
    try:  # the checks of types.Datum, again: a datum may have changed since it was built
        check_loss_fn_inputs(lists, n)
    except ValueError as e:
        raise ValueError(f"datums[{i}].{e}") from None
    if "target_tokens" in inputs:
        inputs["target_tokens"] = _token_ids(
            f"datums[{i}].loss_fn_inputs['target_tokens']", inputs["target_tokens"], vocab_size)
    mask_T = torch.tensor(loss_positions(lists.get("weights"), lists.get("advantages"), n))
    inputs.setdefault("weights", torch.ones(n, dtype=torch.float64))
    if "sequence_ratio_mask" in spec.optional:
        inputs.setdefault("sequence_ratio_mask", mask_T.double())
    inputs["loss_mask"] = mask_T.double()
    return PreparedDatum(tokens_T, inputs, int(mask_T.sum()))


@dataclass
class Chunk:
    """Datums trained in one forward/backward: their inputs padded to (B, T)."""

    indices: list[int]
    tokens_B_T: Tensor
    inputs: dict[str, Tensor]  # each (B, T), zero-padded on the right
    plan: TriePlan | None = None  # how to compute them with shared prefixes, or plainly
    computed_tokens: int = 0  # positions run through the model (padding not counted)
    lengths: list[int] = field(default_factory=list)  # each datum's positions

def make_chunks(
    prepared: Sequence[PreparedDatum], max_tokens: int, device: torch.device
) -> list[Chunk]:
    """Consecutive datums, right-padded, B x T_max <= max_tokens per chunk (>= 1 datum)."""
    groups: list[list[int]] = []
    for i, p in enumerate(prepared):
        if groups:
            t_max = max(p.length, *(prepared[j].length for j in groups[-1]))
            if t_max * (len(groups[-1]) + 1) <= max_tokens:
                groups[-1].append(i)
                continue
        groups.append([i])
    return [pad_chunk(prepared, group, device) for group in groups]


def make_shared_chunks(
    prepared: Sequence[PreparedDatum], max_tokens: int, context_weight: float,
    device: torch.device,
) -> list[Chunk]:
    """Chunks of a prefix-trie plan: each shared position computed once per chunk."""
    tokens = [p.tokens_T.tolist() for p in prepared]
    return [pad_chunk(prepared, plan.indices, device, plan)
            for plan in plan_chunks(tokens, max_tokens, context_weight)]


def pad_chunk(
    prepared: Sequence[PreparedDatum], group: list[int], device: torch.device,
    plan: TriePlan | None = None,
) -> Chunk:
    """Datums `group`, in that order, right-padded with zeros to their longest, on `device`."""
    T = max(prepared[j].length for j in group)
    tokens_B_T = torch.zeros(len(group), T, dtype=torch.long)
    keys = prepared[group[0]].inputs.keys()
    inputs = {
        k: torch.zeros(len(group), T, dtype=prepared[group[0]].inputs[k].dtype) for k in keys
    }
    for b, j in enumerate(group):
        n = prepared[j].length
        tokens_B_T[b, :n] = prepared[j].tokens_T
        for k in keys:
            inputs[k][b, :n] = prepared[j].inputs[k]
    on_device = {
        k: v.to(device) if k == "target_tokens" else v.to(device, torch.float32)
        for k, v in inputs.items()
    }
    computed = plan.computed_tokens if plan is not None else sum(prepared[j].length for j in group)
    return Chunk(group, tokens_B_T.to(device), on_device, plan, computed,
                 [prepared[j].length for j in group])
