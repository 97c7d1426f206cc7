"""PEFT compatibility, against the real `peft` library on tiny transformers models built
here: an adapter prefixgym saves gives, under peft on transformers' model, the logits
of prefixgym's sampler; an adapter peft saves loads into prefixgym with the same logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import prefixgym as pg
from prefixgym.engine.service import EngineService

peft = pytest.importorskip("peft")
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 120
SHAPE: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2,
                         "vocab_size": VOCAB, "initializer_range": 0.2}
TOKENS = [(11 * i + 5) % VOCAB for i in range(30)]


def save_hf(directory: Path, kind: str) -> PreTrainedModel:
    torch.manual_seed(0)
    if kind == "qwen2_tied":
        model: PreTrainedModel = Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True))
    else:
        model = LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False))
    model.save_pretrained(directory, safe_serialization=True)
    return model.eval()


def hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("kind", ["qwen2_tied", "llama_untied"])
def test_prefixgym_adapter_loads_into_peft_with_the_same_logits(kind: str, tmp_path: Path) -> None:
    hf = save_hf(tmp_path / "base", kind)
    with EngineService(str(tmp_path / "base"), thread_tuning=False) as svc:
        lora = svc.create_lora_training_client(rank=4, alpha=8.0, train_unembed=True)
        for _ in range(2):  # move B off zero
            lora.forward_backward([pg.Datum(model_input=pg.ModelInput.from_ints(TOKENS[:-1]),
                                            loss_fn_inputs={"target_tokens": TOKENS[1:]})],
                                  "cross_entropy").result()
            lora.optim_step(pg.AdamParams(learning_rate=0.05)).result()
        path = lora.save_weights_for_sampler(tmp_path / "adapter").result()
        sampler = lora.save_weights_and_get_sampling_client()
        ours = sampler._model(torch.tensor([TOKENS]))[0]
        logprobs = sampler.compute_logprobs(TOKENS).result()
    with torch.no_grad():
        base_logits = hf_logits(hf, TOKENS)
    peft_model = peft.PeftModel.from_pretrained(hf, path).eval()
    theirs = hf_logits(peft_model, TOKENS)
    assert (theirs - base_logits).abs().max() > 1e-2  # the adapter changes the logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    expected = torch.log_softmax(theirs, -1)[:-1].gather(1, torch.tensor(TOKENS[1:])[:, None])
    assert logprobs[1:] == pytest.approx(expected[:, 0].tolist(), abs=1e-4)


@pytest.mark.parametrize("targets,rslora", [
    (["q_proj", "v_proj"], False),  # PEFT's default for Llama: k has no adapter
    (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
     True),
])
def test_peft_adapter_loads_into_prefixgym(targets: list[str], rslora: bool,
                                          tmp_path: Path) -> None:
    hf = save_hf(tmp_path / "base", "llama_untied")
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=targets, use_rslora=rslora,
                             init_lora_weights=False, layers_to_transform=[1] if not rslora
                             else None)
    torch.manual_seed(1)
    peft_model = peft.get_peft_model(hf, config).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    theirs = hf_logits(peft_model, TOKENS)
    with EngineService(str(tmp_path / "base"), thread_tuning=False) as svc:
        base = svc.create_sampling_client()
        sampler = svc.create_sampling_client(model_path=tmp_path / "adapter")
        ours = sampler._model(torch.tensor([TOKENS]))[0]
        assert base.compute_logprobs(TOKENS).result() != sampler.compute_logprobs(TOKENS).result()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
