"""The client protocols that rollouts and the trainer depend on.

Two implementations stand behind `SamplingClient`: the built-in engine's
(`prefixgym.engine.sampler.sampling`) and the OpenAI-compatible HTTP backend
(`prefixgym.serving.openai_client`, and `serving.pool` over several servers); the engine's
is also a `RoundSamplingClient`, which takes a list of requests as one atomic round.
Behind `TrainingClient`: the engine's
(`prefixgym.engine.trainer.training`), its DDP wrapper (`engine.distributed`), and one that
pushes every update to remote samplers (`serving.weight_sync.RemoteWeightSync`).
Rollouts, evaluation and GRPO are typed against these protocols and never import
`engine/` internals; `UsageSink` is where an HTTP sampler reports what it used.

Each method's docstring is its contract: what it returns, what it raises, and what it
never changes. An implementation may do more (the engine's sampler also returns
prompt logprobs on request), never less.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from prefixgym.futures import APIFuture
from prefixgym.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    ModelInput,
    OptimStepOutput,
    SampleRequest,
    SampleResponse,
    SamplingParams,
    Usage,
)


class SamplingClient(Protocol):
    """Samples from one fixed weights version: nothing it does changes those weights."""

    def sample(
        self,
        prompt: ModelInput | list[int],
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
    ) -> APIFuture[SampleResponse]:
        """Queue `num_samples` continuations of `prompt` and return at once. The future's
        response holds `num_samples` sequences: the token ids exactly as sampled, each
        token's logprob under the model's own distribution (temperature 1, no top-k/top-p:
        what an importance ratio needs), a stop reason; and the usage, where prefill
        computed + prefill cached = the prompt's length. The same `sampling_params.seed`
        gives the same tokens. With `include_prompt_logprobs` the prompt is computed whole
        (no cache read) and scored. Raises ValueError now for a request it cannot serve
        (no tokens, an id outside the vocabulary, past the sampler's limits); a failure
        while sampling fails this future alone. May keep the prompt's KV for later hits;
        never serves KV computed under other weights."""
        ...

    def compute_logprobs(self, prompt: ModelInput | list[int]) -> APIFuture[list[float | None]]:
        """The logprob of each prompt token given the ones before it (None for the first),
        from the whole prompt computed anew (no cache read; counted as prefill computed).
        Raises ValueError as `sample` does."""
        ...


@runtime_checkable
class RoundSamplingClient(SamplingClient, Protocol):
    """A sampler that also takes a list of requests as one atomic round, in order (the
    engine's). Rollouts in lockstep submit each turn of all their episodes so."""

    def sample_many(
        self, requests: Sequence[SampleRequest], include_prompt_logprobs: bool = False
    ) -> list[APIFuture[SampleResponse]]:
        """The requests as one round: they reach the sampler together, in list order,
        whatever other threads submit meanwhile; one future per request, in order. Every
        request is checked before any is queued: a ValueError queues none."""
        ...


class TrainingClient(Protocol):
    """Trains one set of weights; its calls run in the order they were made."""

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Add d(loss)/d(params) over `data` to the accumulated gradients. The whole call
        is checked first: a bad datum, loss name or config raises ValueError naming it,
        and a loss or gradient that is not finite fails the call; either way the
        accumulated gradients are left as they were. The output: each datum's logprobs of
        its targets (one per position), metrics (`loss:sum`: weight x per-token loss
        summed over positions, no mean taken), and usage (`train_computed_tokens`: every
        position run through the model, a prefix shared by datums of the call once).
        Never changes the weights."""
        ...

    def optim_step(self, adam: AdamParams) -> APIFuture[OptimStepOutput]:
        """One AdamW update from the accumulated gradients, which it then zeroes. An update
        whose gradient norm is NaN or inf is skipped (the output's metrics say so) or
        raises, as the client was made; it never applies. Publishes nothing: samplers see
        new weights only through `save_weights_and_get_sampling_client`."""
        ...

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> SamplingClient:
        """Publish the current weights as a new version and return a sampler of exactly
        them, which later updates never change. Raises (ValueError) rather than publish
        weights holding NaN or inf."""
        ...

    def save_state(self, path: str | os.PathLike[str],
                   with_optimizer: bool = True) -> APIFuture[str]:
        """Write the weights, the optimizer's state and step, and the RNG states under
        `path`, whole or not at all (a crash leaves no half-written state there); the
        future's result is the path. Gradients accumulated since the last update are not
        saved. Changes nothing of the client. `with_optimizer=False` leaves the
        optimizer's state out (AdamW's moments: twice the weights); a client whose
        checkpoints live elsewhere (the hosted service) may keep it anyway."""
        ...

    def load_state(self, path: str | os.PathLike[str]) -> APIFuture[int]:
        """Restore what `save_state` wrote; the future's result is the optimizer step it
        restored (0 from a state saved without the optimizer's, which starts afresh).
        Pending gradients are dropped. A damaged checkpoint, or one of another model,
        raises ValueError and changes nothing."""
        ...


class UsageSink(Protocol):
    """Receives each response's usage (the engine's `UsageLedger` is one)."""

    def add(self, usage: Usage) -> None:
        """Add one response's usage to the running totals; safe from any thread."""
        ...


@runtime_checkable
class AgentGateway(Protocol):
    """Where agent programs send their OpenAI calls during rollouts: a base URL per
    rollout, each call recorded in that rollout's call tree (`serving.agent_gateway`)."""

    api_key: str | None

    def open(self, key: str, tree: Any, sampler: SamplingClient, seed: int,
             temperature: float | None = None) -> str:
        """Serve the rollout `key` at a base URL of its own, whose calls continue `tree`
        (a `prompting.call_tree.CallTree`: protocols may not import prompting) and are
        sampled from `sampler` with seeds fixed by `seed`, at `temperature` unless a call
        sets its own (None: the gateway's default). Returns the base URL."""
        ...

    def close(self, key: str) -> list[str]:
        """Stop serving `key` (later calls to it are refused); one line per call of it the
        gateway refused (a wrong model name, a malformed request)."""
        ...
