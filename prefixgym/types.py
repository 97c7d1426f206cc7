"""The wire types every part of prefixgym speaks: a glossary in pydantic.

These are the request and response shapes of the sampling and training services
(the built-in engine, `prefixgym serve`, or a remote OpenAI-compatible server).
They validate what they can see on their own -- ranges, lengths, finite numbers --
and know nothing of a vocabulary, a model or a cache: checks that need those (a token
id outside the vocabulary, say) belong to the service that has them.

Every invalid value is refused with `pydantic.ValidationError`, a `ValueError` whose
message names the field and the value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

if TYPE_CHECKING:
    from prefixgym.pricing import Cost, Prices

StopReason = Literal["stop", "length"]
JSONObject = dict[str, Any]
"""A parsed JSON object (a metrics line, a request body, env kwargs): its values may be
any JSON type, hence `Any`."""
LossFnName = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo",
                     "stable_reinforce"]
LOSS_FN_NAMES: tuple[LossFnName, ...] = get_args(LossFnName)
"""Every built-in loss, as `forward_backward(loss_fn=...)` names it: the engine's losses
(`engine/trainer/losses.py`, keyed by these) and `prefixgym train --loss` read this one
list."""
OFF_POLICY_LOSS_FN_NAMES: tuple[LossFnName, ...] = tuple(
    n for n in LOSS_FN_NAMES if n != "cross_entropy")
"""The losses that take an off-policy correction (`engine/trainer/off_policy.py`): every
one that reads the sampler's logprobs (all but cross_entropy); its decoupled form takes
fewer (`DECOUPLED_LOSS_FN_NAMES`)."""
DECOUPLED_LOSS_FN_NAMES: tuple[LossFnName, ...] = ("importance_sampling", "ppo", "cispo", "gspo")
"""The losses that take the decoupled form of a correction: dro's and
stable_reinforce's penalties are on the log-ratio to the sampler itself, which that
form would make zero."""
NonfiniteUpdate = Literal["skip", "error"]
NONFINITE_UPDATES: tuple[NonfiniteUpdate, ...] = get_args(NonfiniteUpdate)
"""What an update whose gradient norm is NaN or inf does: skip it (counted) or raise."""


@dataclass(frozen=True)
class TrainingSettings:
    """The training client's settings that `prefixgym train` takes as flags, with their
    defaults and checks written once: the engine's `TrainerOptions` and the command's
    `TrainConfig` (neither may import the other) both take their defaults from
    `TRAINING_DEFAULTS` and check with `check_training_settings`."""

    nonfinite_update: NonfiniteUpdate = "skip"
    share_prefixes: bool = True
    recompute_activations: bool = False
    router_aux_loss_coef: float = 0.0


TRAINING_DEFAULTS = TrainingSettings()


def check_training_settings(nonfinite_update: str, router_aux_loss_coef: float,
                            name: Callable[[str], str] = str) -> None:
    """ValueError for a setting of `TrainingSettings` out of its range, naming it as
    `name` spells a field (a command: its flag)."""
    if nonfinite_update not in NONFINITE_UPDATES:
        raise ValueError(f"{name('nonfinite_update')} must be one of "
                         f"{', '.join(NONFINITE_UPDATES)}, got {nonfinite_update!r}")
    if not (router_aux_loss_coef >= 0 and math.isfinite(router_aux_loss_coef)):
        raise ValueError(f"{name('router_aux_loss_coef')} must be a finite number >= 0, got "
                         f"{router_aux_loss_coef!r}")


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class ModelInput(_Wire):
    """A token sequence given to the model: a prompt, or a datum's inputs. Ids are
    ints as given: `True`, `"7"` or `7.0` are refused, not read as 1 and 7."""

    tokens: list[StrictInt] = Field(min_length=1, description="Token ids, at least one.")

    @field_validator("tokens")
    @classmethod
    def _non_negative(cls, tokens: list[int]) -> list[int]:
        for i, t in enumerate(tokens):
            if t < 0:
                raise ValueError(f"token id {t} at index {i} is negative")
        return tokens

    @classmethod
    def from_ints(cls, ids: list[int]) -> ModelInput:
        return cls(tokens=list(ids))

    def to_ints(self) -> list[int]:
        return list(self.tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)


class SamplingParams(_Wire):
    """How to decode. `temperature=0` is greedy; `top_k=-1` and `top_p=1` turn those off."""

    max_tokens: int = Field(default=64, ge=0, description="Tokens to decode at most.")
    temperature: float = Field(default=1.0, ge=0.0, description="0 means greedy.")
    top_k: int = Field(default=-1, description="Keep the k most likely tokens; -1 keeps all.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus mass, in (0, 1].")
    stop: list[str] = Field(default_factory=list, description="Stop strings (kept in the output).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Stop token ids (kept).")
    seed: int | None = Field(default=None, description="Same seed, same tokens.")

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {value}")
        return value

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"must be finite, got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value


def derived_seed(seed: int, k: int) -> int:
    """A distinct, reproducible sampling seed for the k-th use of `seed` (a group's
    episodes and turns, an agent rollout's calls)."""
    return (seed * 1_000_003 + k * 7919) % (2**31 - 1)


class AdamParams(_Wire):
    """One AdamW update. `grad_clip_norm=0` turns clipping off."""

    learning_rate: float = Field(default=1e-4, ge=0.0,
                                 description="0 is allowed (a schedule's last step), as the "
                                 "hosted service allows it.")
    beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    beta2: float = Field(default=0.95, ge=0.0, lt=1.0)
    eps: float = Field(default=1e-8, gt=0.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    grad_clip_norm: float = Field(default=0.0, ge=0.0)

    @field_validator("learning_rate", "eps", "weight_decay", "grad_clip_norm")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"must be finite, got {value}")
        return value


def check_loss_fn_inputs(inputs: Mapping[str, Sequence[float]], n: int) -> None:
    """What every datum's loss inputs satisfy, when it is built and when it is trained
    on: one value per position (`n`), all finite, target ids non-negative integers.
    Raises ValueError naming the key and the index."""
    for key, values in inputs.items():
        if len(values) != n:
            raise ValueError(
                f"loss_fn_inputs[{key!r}] has {len(values)} values but model_input has "
                f"{n} tokens; every loss input needs one value per position"
            )
        for i, v in enumerate(values):
            if not math.isfinite(v):
                raise ValueError(f"loss_fn_inputs[{key!r}][{i}] = {v}; values must be finite")
    for i, t in enumerate(inputs.get("target_tokens", ())):
        if t != int(t) or t < 0:
            raise ValueError(
                f"loss_fn_inputs['target_tokens'][{i}] = {t}; target ids are non-negative "
                "integers"
            )


def loss_positions(
    weights: Sequence[float] | None, advantages: Sequence[float] | None, n: int
) -> list[bool]:
    """The positions a datum trains on: non-zero weight where it has weights; without
    weights, non-zero advantage where it has advantages (an RL datum built the hosted
    service's way has advantage 0 on its prompt, which must not count in ratio/KL metrics
    or loss-token counts); otherwise all `n`."""
    if weights is not None:
        return [w != 0 for w in weights]
    if advantages is not None:
        return [a != 0 for a in advantages]
    return [True] * n


class Datum(_Wire):
    """One training sequence: inputs, and per-position loss inputs of the same length.

    `loss_fn_inputs` keys by loss: `cross_entropy` needs `target_tokens` and takes
    `weights` (default 1); `importance_sampling` and `ppo` need `target_tokens`,
    `logprobs` (the sampler's) and `advantages`, and take `weights`.
    """

    model_input: ModelInput
    loss_fn_inputs: dict[str, list[float] | list[int]]

    @model_validator(mode="after")
    def _aligned_and_finite(self) -> Datum:
        check_loss_fn_inputs(self.loss_fn_inputs, self.model_input.length)
        return self

    @property
    def num_loss_tokens(self) -> int:
        """Its loss positions (`loss_positions`)."""
        inputs = self.loss_fn_inputs
        return sum(loss_positions(inputs.get("weights"), inputs.get("advantages"),
                                  self.model_input.length))


class Usage(_Wire):
    """Tokens per phase. Prefill computed + prefill cached = prompt length, per request."""

    prefill_computed_tokens: int = 0
    prefill_cached_tokens: int = 0
    sampled_tokens: int = 0
    train_computed_tokens: int = 0
    train_loss_tokens: int = 0
    train_shared_tokens: int = 0
    """Datum positions not computed because another datum of the same forward/backward
    chunk had the same token prefix (see `train_tokens`)."""

    def __add__(self, other: Usage) -> Usage:
        return Usage(**{k: getattr(self, k) + getattr(other, k) for k in Usage.model_fields})

    def __sub__(self, other: Usage) -> Usage:
        return Usage(**{k: getattr(self, k) - getattr(other, k) for k in Usage.model_fields})

    @classmethod
    def total(cls, usages: Iterable[Usage]) -> Usage:
        out = cls()
        for u in usages:
            out = out + u
        return out

    @property
    def prefill_tokens(self) -> int:
        """What prefill would have computed without a prefix cache."""
        return self.prefill_computed_tokens + self.prefill_cached_tokens

    @property
    def train_tokens(self) -> int:
        """What training would have computed without shared prefixes: every datum's every
        position."""
        return self.train_computed_tokens + self.train_shared_tokens

    @property
    def computed_tokens(self) -> int:
        """Prefill computed + sampled + train computed: the work paid for in full."""
        return self.prefill_computed_tokens + self.sampled_tokens + self.train_computed_tokens

    @property
    def tokens_without_sharing(self) -> int:
        """What would be computed with no prefix cache and no shared prefixes: every prompt
        token, every sampled one, every datum position."""
        return self.prefill_tokens + self.sampled_tokens + self.train_tokens

    @property
    def cache_hit_rate(self) -> float:
        total = self.prefill_tokens
        return self.prefill_cached_tokens / total if total else 0.0

    def cost(self, prices: Prices) -> Cost:
        """These tokens' money per phase at `prices` (`prefixgym.pricing`), with what
        they would have cost without the prefix cache and without shared prefixes."""
        return prices.cost(prefill_computed=self.prefill_computed_tokens,
                           prefill_cached=self.prefill_cached_tokens,
                           sampled=self.sampled_tokens,
                           train_computed=self.train_computed_tokens,
                           train_shared=self.train_shared_tokens)


TopkLogprobs = list[tuple[int, float]]
"""The k most likely next tokens at one position: (token id, logprob), most likely first."""


class SampledSequence(_Wire):
    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    sequence_id: str | None = None
    """Names this sequence in later requests (the hosted service's field); unique in the
    service that sampled it."""


class SampleRequest(NamedTuple):
    """One request of a `sample_many` round: `sample`'s arguments."""

    prompt: ModelInput | list[int]
    num_samples: int = 1
    sampling_params: SamplingParams | None = None


class SampleResponse(_Wire):
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    usage: Usage = Field(default_factory=Usage)
    weights_version: str | None = None
    """The label of the weights that sampled it, where the sampler says (a remote
    server's `metadata.weight_version`); None from the in-process engine."""
    prompt_cache_hit_tokens: int = 0
    """Prompt tokens served from the prefix cache, counted once per request (the hosted
    service's field; the same number as `usage.prefill_cached_tokens`)."""
    topk_prompt_logprobs: list[TopkLogprobs | None] | None = None
    """With `topk_prompt_logprobs=k`: per prompt position, its k most likely tokens
    (None where not scored: position 0, and before `prompt_logprobs_last_n`)."""


class ForwardBackwardOutput(_Wire):
    loss_fn_outputs: list[dict[str, list[float]]]
    metrics: dict[str, float] = Field(default_factory=dict)
    usage: Usage = Field(default_factory=Usage)


class OptimStepOutput(_Wire):
    metrics: dict[str, float] = Field(default_factory=dict)
