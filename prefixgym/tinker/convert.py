"""Conversions between the `tinker` package's types and prefixgym's, and nothing else.

Both directions of `prefixgym.tinker` use them: the `ServiceClient` that serves tinker's
types from a LocalService (tinker -> ours on the way in, ours -> tinker on the way out),
and the backend that runs our rollouts and trainer on the hosted service (the reverse).
Where tinker's meaning differs from ours the conversion says so in one place:
- `SamplingParams.stop`: tinker takes strings *or* token ids; `None` keeps the
  end-of-sequence stop and `[]` turns every stop off; `max_tokens=None` means "up to
  the context". Ours: strings and ids side by side, end-of-turn added by the client.
- loss inputs: tinker's `TensorData` / numpy / torch arrays; ours: flat lists.
- usage: tinker reports only `prompt_cache_hit_tokens`; our `Usage` is rebuilt from it.
This module knows the two type systems; not clients, services or the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tinker import types as tt

from prefixgym.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    ModelInput,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    Usage,
)

# -- tinker -> prefixgym ---------------------------------------------------------------


def token_ids(model_input: object, where: str = "model_input") -> list[int]:
    """The token ids of a tinker `ModelInput` (token chunks only), ours, or a list."""
    if isinstance(model_input, tt.ModelInput):
        try:
            return [int(t) for t in model_input.to_ints()]
        except ValueError as e:  # an image or other non-token chunk
            raise NotImplementedError(f"{where}: only token chunks are supported ({e})") from None
    if isinstance(model_input, ModelInput):
        return model_input.to_ints()
    if isinstance(model_input, (list, tuple)):
        return [int(t) for t in model_input]
    raise ValueError(f"{where} must be a tinker ModelInput, got {type(model_input).__name__}")


def flat_values(value: object, where: str) -> list[float] | list[int]:
    """A loss input (`TensorData`, numpy or torch array, list) as a flat list."""
    if isinstance(value, tt.TensorData):
        shape = value.shape
        values: Any = value.tolist()
    elif hasattr(value, "tolist"):  # numpy or torch
        shape = list(getattr(value, "shape", []))
        values = value.tolist()
    else:
        shape, values = None, value
    if shape is not None and len(shape) != 1:
        raise NotImplementedError(f"{where} has shape {shape}; only 1-D loss inputs are supported")
    if not isinstance(values, list):
        raise ValueError(f"{where} must be a 1-D array, got {type(value).__name__}")
    return values


def to_datum(datum: object, i: int) -> Datum:
    """A tinker `Datum` as ours (provenance spans are not needed locally: dropped)."""
    if not isinstance(datum, (tt.Datum, Datum)):
        raise ValueError(f"data[{i}] must be a tinker Datum, got {type(datum).__name__}")
    if isinstance(datum, Datum):
        return datum
    ids = token_ids(datum.model_input, f"data[{i}].model_input")
    inputs = {k: flat_values(v, f"data[{i}].loss_fn_inputs[{k!r}]")
              for k, v in datum.loss_fn_inputs.items()}
    if "target_tokens" in inputs:
        inputs["target_tokens"] = [int(t) for t in inputs["target_tokens"]]
    return Datum(model_input=ModelInput.from_ints(ids), loss_fn_inputs=inputs)


def to_sampling_params(
    params: object, prompt_len: int, max_seq_len: int, end_of_sequence_ids: Sequence[int]
) -> SamplingParams:
    """tinker's `SamplingParams` as ours, with the end-of-sequence stop made explicit."""
    if isinstance(params, SamplingParams):
        return params
    if not isinstance(params, tt.SamplingParams):
        raise ValueError(f"sampling_params must be a tinker SamplingParams, got "
                         f"{type(params).__name__}")
    stop = params.stop
    strings: list[str] = []
    ids: list[int] = []
    if stop is None:
        ids = list(end_of_sequence_ids)
    elif isinstance(stop, str):
        strings = [stop]
    elif all(isinstance(s, str) for s in stop):
        strings = [str(s) for s in stop]
    else:
        ids = [int(s) for s in stop]
    max_tokens = params.max_tokens if params.max_tokens is not None else max_seq_len - prompt_len
    return SamplingParams(max_tokens=max_tokens, temperature=params.temperature,
                          top_k=params.top_k, top_p=params.top_p, stop=strings,
                          stop_token_ids=ids, seed=params.seed)


def to_adam(params: object) -> AdamParams:
    if isinstance(params, AdamParams):
        return params
    if not isinstance(params, tt.AdamParams):
        raise NotImplementedError(f"only AdamParams are supported, got {type(params).__name__}")
    return AdamParams(learning_rate=params.learning_rate, beta1=params.beta1, beta2=params.beta2,
                      eps=params.eps, weight_decay=params.weight_decay,
                      grad_clip_norm=params.grad_clip_norm)


# -- prefixgym -> tinker ---------------------------------------------------------------


def to_tinker_forward_backward(out: ForwardBackwardOutput) -> tt.ForwardBackwardOutput:
    outputs = [{key: tt.TensorData(data=values, dtype="float32", shape=[len(values)])
                for key, values in item.items()} for item in out.loss_fn_outputs]
    return tt.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs,
                                    metrics=dict(out.metrics))


def to_tinker_sample_response(response: SampleResponse) -> tt.SampleResponse:
    """The SDK's response, with both its list fields (our exact floats) and its numpy
    ones (`tokens_np` int32, `logprobs_np` and `prompt_logprobs_np` float32, NaN where
    a position has none), as its wire decoder fills them."""
    sequences = [tt.SampledSequence(stop_reason=s.stop_reason, sequence_id=s.sequence_id or "",
                                    tokens_np=np.asarray(s.tokens, dtype=np.int32),
                                    logprobs_np=np.asarray(s.logprobs, dtype=np.float32),
                                    _tokens_list=list(s.tokens), _logprobs_list=list(s.logprobs))
                 for s in response.sequences]
    prompt = response.prompt_logprobs
    prompt_np = (None if prompt is None else np.asarray(
        [np.nan if p is None else p for p in prompt], dtype=np.float32))
    return tt.SampleResponse(sequences=sequences,
                             prompt_cache_hit_tokens=response.prompt_cache_hit_tokens,
                             prompt_logprobs_np=prompt_np,
                             _prompt_logprobs_list=response.prompt_logprobs,
                             _topk_prompt_logprobs_list=response.topk_prompt_logprobs)


def to_tinker_datum(datum: Datum) -> tt.Datum:
    inputs = {k: tt.TensorData(data=list(v), dtype="int64" if k == "target_tokens" else "float32",
                               shape=[len(v)]) for k, v in datum.loss_fn_inputs.items()}
    return tt.Datum(model_input=tt.ModelInput.from_ints(datum.model_input.to_ints()),
                    loss_fn_inputs=inputs)


def to_tinker_sampling_params(params: SamplingParams) -> tt.SamplingParams:
    """Ours as tinker's. tinker stops at strings or ids, not both; with neither it keeps
    its end-of-sequence stop (what our clients add as end-of-turn ids)."""
    if params.stop and params.stop_token_ids:
        raise ValueError("the hosted service stops at strings or at token ids, not both: "
                         f"got stop={params.stop} and stop_token_ids={params.stop_token_ids}")
    stop: list[str] | list[int] | None = (list(params.stop) or list(params.stop_token_ids)
                                         or None)
    return tt.SamplingParams(max_tokens=params.max_tokens, seed=params.seed, stop=stop,
                             temperature=params.temperature, top_k=params.top_k,
                             top_p=params.top_p)


def from_tinker_sample_response(response: tt.SampleResponse, prompt_len: int) -> SampleResponse:
    """tinker's response as ours; usage from `prompt_cache_hit_tokens`."""
    sequences = [SampledSequence(tokens=list(s.tokens), logprobs=list(s.logprobs or []),
                                 stop_reason=s.stop_reason, sequence_id=s.sequence_id)
                 for s in response.sequences]
    hit = int(response.prompt_cache_hit_tokens)
    usage = Usage(prefill_computed_tokens=prompt_len - hit, prefill_cached_tokens=hit,
                  sampled_tokens=sum(len(s.tokens) for s in sequences))
    return SampleResponse(sequences=sequences, prompt_logprobs=response.prompt_logprobs,
                          usage=usage, prompt_cache_hit_tokens=hit,
                          topk_prompt_logprobs=response.topk_prompt_logprobs)


def from_tinker_forward_backward(
    out: tt.ForwardBackwardOutput, usage: Usage
) -> ForwardBackwardOutput:
    outputs = [{key: [float(v) for v in flat_values(value, f"loss_fn_outputs[{i}][{key!r}]")]
                for key, value in item.items()} for i, item in enumerate(out.loss_fn_outputs)]
    metrics: Mapping[str, float] = out.metrics or {}
    merged = {**metrics, "loss": float(metrics.get("loss:sum", 0.0))}
    return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=merged, usage=usage)
