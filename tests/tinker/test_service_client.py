"""prefixgym.tinker.ServiceClient: tinker's types and futures in and out, the local engine
behind (full-weight training clients here; the LoRA ones in test_recipes.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

# "tinker.types", not "tinker": without the SDK, this folder itself (tests/tinker/)
# imports as a namespace package called tinker
pytest.importorskip("tinker.types")
from tinker import types  # noqa: E402

from prefixgym.engine.model.config import PRESETS  # noqa: E402
from prefixgym.local_service import LocalService  # noqa: E402
from prefixgym.tinker import ServiceClient  # noqa: E402


@pytest.fixture
def client(tmp_path: Path) -> Iterator[ServiceClient]:
    with ServiceClient(checkpoint_dir=tmp_path) as service_client:
        yield service_client


def sft_datum(ids: list[int]) -> types.Datum:
    """A datum as tinker users build it: torch tensors wrapped in TensorData."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": types.TensorData.from_torch(torch.tensor(ids[1:])),
                        "weights": types.TensorData.from_torch(torch.ones(len(ids) - 1))})


def test_training_takes_and_returns_tinkers_types(client: ServiceClient) -> None:
    trainer = client.create_training_client(base_model="tiny").result()
    data = [sft_datum(list(range(10, 30))), sft_datum(list(range(40, 52)))]
    out = trainer.forward_backward(data, "cross_entropy").result()
    assert isinstance(out, types.ForwardBackwardOutput)
    logprobs = out.loss_fn_outputs[1]["logprobs"].to_torch()
    assert logprobs.shape == (11,)
    assert out.metrics["loss:sum"] == pytest.approx(
        -sum(o["logprobs"].to_torch().sum().item() for o in out.loss_fn_outputs), rel=1e-5)
    step = trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert isinstance(step, types.OptimStepResponse) and step.metrics["step"] == 1.0
    after = trainer.forward(data, "cross_entropy").result()
    assert after.metrics["loss:sum"] < out.metrics["loss:sum"]
    # lr 0, which tinker allows (a linear schedule's last step), is accepted
    trainer.optim_step(adam_params=types.AdamParams(learning_rate=0.0)).result()


def test_sampling_stops_as_tinker_says(tmp_path: Path) -> None:
    # the tiny preset with a 64-token context: `max_tokens=None` (up to the context's
    # end) samples 2048 tokens one by one on the full preset
    short = dataclasses.replace(PRESETS["tiny"], max_seq_len=64)
    with LocalService(model=short, seed=0) as service, \
            ServiceClient(service=service, checkpoint_dir=tmp_path) as client:
        sampling_stops_as_tinker_says(client)


def sampling_stops_as_tinker_says(client: ServiceClient) -> None:
    trainer = client.create_training_client(base_model="tiny").result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    tokenizer = sampler.get_tokenizer()
    prompt = types.ModelInput.from_ints(tokenizer.encode("count: one two three"))
    eos = tokenizer.eos_token_id

    def sample(stop: object, max_tokens: int | None = 40) -> types.SampleResponse:
        params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=3, stop=stop)
        return sampler.sample(prompt, num_samples=4, sampling_params=params).result()

    free = sample([])  # [] turns every stop off
    assert all(len(s.tokens) == 40 and s.stop_reason == "length" for s in free.sequences)
    token = free.sequences[0].tokens[5]
    by_id = sample([token])
    assert by_id.sequences[0].tokens == free.sequences[0].tokens[:6]  # same seed, stops there
    assert by_id.sequences[0].stop_reason == "stop"
    default = sample(None)  # None keeps the end-of-sequence stop
    for seq in default.sequences:
        assert (seq.stop_reason == "stop") == (eos in seq.tokens)
    assert len({s.sequence_id for s in default.sequences}) == 4
    again = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=None, seed=1)).result()
    # the samples before left the prompt in the cache (its partial last block too): every
    # token but the last, whose logits are computed, is a hit
    assert again.prompt_cache_hit_tokens == len(prompt.to_ints()) - 1
    assert isinstance(again.sequences[0].logprobs, list)
    # the numpy fields too, as the SDK's wire decoder fills them
    first = free.sequences[0]
    assert first.tokens_np is not None and first.tokens_np.dtype == np.int32
    assert first.tokens_np.tolist() == first.tokens
    assert first.logprobs_np is not None and first.logprobs is not None
    assert np.allclose(first.logprobs_np, first.logprobs)
    scored = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1),
                            include_prompt_logprobs=True).result()
    assert scored.prompt_logprobs_np is not None and scored.prompt_logprobs is not None
    assert np.isnan(scored.prompt_logprobs_np[0]) and scored.prompt_logprobs[0] is None
    assert np.allclose(scored.prompt_logprobs_np[1:], scored.prompt_logprobs[1:])
    # max_tokens=None: up to the context's end (64 tokens here), or the end of sequence
    (seq,) = again.sequences
    if seq.stop_reason == "length":
        assert len(seq.tokens) == 64 - len(prompt.to_ints())
    else:
        assert seq.tokens[-1] == eos and len(seq.tokens) < 64 - len(prompt.to_ints())


def test_save_and_resume_with_optimizer_is_exact(client: ServiceClient, tmp_path: Path) -> None:
    data = [sft_datum(list(range(5, 25)))]
    trainer = client.create_training_client(base_model="tiny").result()
    trainer.forward_backward(data, "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = trainer.save_state("one").result().path
    with pytest.raises(ValueError, match="overwrite"):
        trainer.save_state("one")
    trainer.forward_backward(data, "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    expected = trainer.forward(data, "cross_entropy").result().metrics["loss:sum"]

    with ServiceClient(checkpoint_dir=tmp_path) as fresh:  # another process, one root
        resumed = fresh.create_training_client_from_state_with_optimizer(path).result()
        resumed.forward_backward(data, "cross_entropy").result()
        resumed.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        got = resumed.forward(data, "cross_entropy").result().metrics["loss:sum"]
        assert got == pytest.approx(expected, rel=1e-5)
        weights_only = fresh.create_training_client_from_state(path).result()
        assert weights_only.get_info().model_data.model_name == "tiny"


def test_custom_loss_gets_tinkers_datums_and_tensors(client: ServiceClient) -> None:
    trainer = client.create_training_client(base_model="tiny").result()
    data = [sft_datum(list(range(10, 20)))]
    seen: list[object] = []

    def loss_fn(batch: list[types.Datum], logprobs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        seen.append(batch[0])
        return -logprobs[0].sum(), {"n": float(logprobs[0].numel())}

    out = trainer.forward_backward_custom(data, loss_fn).result()
    plain = trainer.forward(data, "cross_entropy").result()
    assert seen == [data[0]] and out.metrics["n"] == 9.0
    assert out.metrics["loss:sum"] == pytest.approx(plain.metrics["loss:sum"], rel=1e-5)


def test_async_variants_and_unsupported_methods_name_themselves(client: ServiceClient) -> None:
    async def run() -> float:
        trainer = await client.create_training_client(base_model="tiny")
        future = await trainer.forward_backward_async([sft_datum(list(range(3, 13)))],
                                                      "cross_entropy")
        result = await future.result_async()
        return float(result.metrics["loss:sum"])

    assert asyncio.run(run()) > 0
    with pytest.raises(NotImplementedError, match="RestClient.get_session"):
        client.create_rest_client().get_session("s")
    trainer = client.create_training_client(base_model="tiny").result()
    with pytest.raises(NotImplementedError, match="TrainingClient.save_weights_external"):
        trainer.save_weights_external("x")
    sampler = trainer.save_weights_and_get_sampling_client().result()
    with pytest.raises(NotImplementedError, match="prompt_alt_tokens_k"):
        sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(),
                       prompt_alt_tokens_k=2)

