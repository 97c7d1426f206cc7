"""Devices: has_fast_bf16 against the CPU's flags, and the whole engine on one device.

The suite runs on CPU. `PREFIXGYM_TEST_DEVICE=cuda` (or `mps`, `cuda:1`, ...) runs the
device tests below on that device instead:

    PREFIXGYM_TEST_DEVICE=cuda .venv/bin/python -m pytest tests/engine/test_device.py
"""

import os
import platform
from pathlib import Path

import pytest
import torch

from prefixgym.engine.device import has_fast_bf16
from prefixgym.engine.model import ModelConfig
from prefixgym.local_service import LocalService
from prefixgym.types import AdamParams, Datum, ModelInput, SamplingParams

DEVICE = os.environ.get("PREFIXGYM_TEST_DEVICE", "cpu")
SMALL = ModelConfig(vocab_size=4096, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    hidden_dim=128, max_seq_len=512)


@pytest.mark.skipif(
    torch.cuda.is_available() or platform.machine() != "x86_64"
    or not Path("/proc/cpuinfo").exists(),
    reason="reads x86 CPU flags from /proc/cpuinfo",
)
def test_bf16_is_fast_exactly_where_the_cpu_has_bf16_instructions():
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    assert has_fast_bf16() == bool(flags & {"avx512_bf16", "amx_bf16"})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampling_and_training_live_on_the_service_device(dtype: str) -> None:
    with LocalService(SMALL, seed=0, block_size=8, dtype=dtype, device=DEVICE) as svc:
        device = torch.device(DEVICE)
        assert all(p.device.type == device.type for p in svc.train_model.parameters())
        pool = svc.engine.runner.pool
        assert pool.k.device.type == device.type == pool.v.device.type
        sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
        prompt = list(range(10, 31))
        params = SamplingParams(max_tokens=6, temperature=1.0, top_k=50, top_p=0.9, seed=3)
        first = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
        again = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
        assert again.usage.prefill_cached_tokens == len(prompt) - 1
        assert [s.tokens for s in again.sequences] == [s.tokens for s in first.sequences]
        reference = sampler.compute_logprobs(prompt + first.sequences[0].tokens).result()
        tol = 1e-4 if dtype == "float32" else 0.05
        assert first.sequences[0].logprobs == pytest.approx(reference[len(prompt):], abs=tol)
        trainer = svc.create_training_client()
        tokens = prompt + first.sequences[0].tokens
        datum = Datum(model_input=ModelInput.from_ints(tokens[:-1]),
                      loss_fn_inputs={"target_tokens": tokens[1:]})
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(AdamParams(learning_rate=1e-3)).result()
        new = trainer.save_weights_and_get_sampling_client()
        assert new.sample(prompt, sampling_params=params).result().usage.prefill_cached_tokens == 0
        svc.check_cache_integrity()


def test_an_unusable_device_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="device 'nodevice' is not usable"):
        LocalService(SMALL, device="nodevice")
