"""Families with no code here run through transformers' own modeling code, our KV
views behind its attention (hf_fallback.py): tiny random-init checkpoints of families
we do not convert, saved by transformers here, against transformers' own forward --
logprobs over 256 positions, sampling with the prefix cache and without, full-training
gradients, the export read back -- and the refusals, one line each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from numerics import BF16, max_abs_logit

import prefixgym as pg
from prefixgym.engine.model import load_model
from prefixgym.engine.model.hf_export import save_hf_checkpoint
from prefixgym.engine.model.hf_fallback import TransformersCodeModel
from prefixgym.engine.service import EngineService

VOCAB, POSITIONS, WINDOW = 512, 256, 48
SHAPE: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "vocab_size": VOCAB,
                         "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2,
                         "pad_token_id": 0}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt_neox": ("GPTNeoX", {"rotary_pct": 0.5}),  # parallel residual, LayerNorm, half rotary
    "starcoder2": ("Starcoder2", {"num_key_value_heads": 2, "sliding_window": WINDOW}),
    "phi": ("Phi", {"partial_rotary_factor": 0.5, "resid_pdrop": 0.5}),  # dropout: off here
    "stablelm": ("StableLm", {"num_key_value_heads": 2}),  # drops attention's keywords
    "cohere": ("Cohere", {"num_key_value_heads": 2, "logit_scale": 0.5}),
    "granitemoe": ("GraniteMoe", {"num_key_value_heads": 2, "num_local_experts": 4,
                                  "num_experts_per_tok": 2, "logits_scaling": 4.0,
                                  "embedding_multiplier": 6.0}),
}


def save_hf(directory: Path, case: str, **more: Any) -> torch.nn.Module:
    arch, overrides = CASES[case]
    torch.manual_seed(0)
    model = getattr(tf, f"{arch}ForCausalLM")(getattr(tf, f"{arch}Config")(
        **{**SHAPE, **overrides, **more}))
    with torch.no_grad():  # norms and biases off transformers' 1 and 0: every weight matters
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    return model.eval()


def tokens(n: int = POSITIONS + 1, seed: int = 1) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path, torch.nn.Module]:
    return request.param, tmp_path / "hf", save_hf(tmp_path / "hf", request.param)


def test_the_engine_gives_transformers_logprobs_cached_or_not(case) -> None:
    name, directory, hf = case
    ids = tokens()
    expected = hf_logprobs(hf, ids).tolist()
    with EngineService(str(directory), thread_tuning=False) as svc:
        model = svc.train_model
        assert isinstance(model, TransformersCodeModel) and model.config.family == "transformers"
        assert model.config.windows == ((WINDOW, WINDOW) if name == "starcoder2" else (0, 0))
        sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
        assert sampler.compute_logprobs(ids).result()[1:] == pytest.approx(expected, abs=1e-4)
        params = pg.SamplingParams(max_tokens=12, temperature=1.0, seed=5)
        sampler.sample(ids[:200], sampling_params=pg.SamplingParams(max_tokens=1)).result()
        cached = sampler.sample(ids[:240], sampling_params=params, num_samples=2).result()
    assert cached.usage.prefill_cached_tokens >= 192
    with EngineService(str(directory), thread_tuning=False, prefix_cache=False) as svc:
        plain = svc.create_sampling_client(stop_at_end_of_turn=False).sample(
            ids[:240], sampling_params=params, num_samples=2).result()
    for a, b in zip(cached.sequences, plain.sequences, strict=True):
        assert a.tokens == b.tokens
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_training_gradients_are_transformers(case) -> None:
    _, directory, hf = case
    ids = tokens(POSITIONS + 1, seed=2)
    datum = pg.Datum(model_input=pg.ModelInput.from_ints(ids[:-1]),
                     loss_fn_inputs={"target_tokens": ids[1:]})
    with EngineService(str(directory), thread_tuning=False) as svc:
        out = svc.create_training_client().forward_backward([datum], "cross_entropy").result()
        ours = {n.removeprefix("hf."): p.grad for n, p in svc.train_model.named_parameters()}
    logits = hf(torch.tensor([ids[:-1]])).logits[0].float()  # eval mode: no dropout
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum")
    loss.backward()
    assert out.metrics["loss:sum"] == pytest.approx(float(loss), rel=1e-5)
    theirs = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    assert sorted(theirs) == sorted(k for k, g in ours.items() if g is not None)
    for key, grad in theirs.items():
        scale = float(grad.abs().max())
        assert float((ours[key] - grad).abs().max()) <= 1e-4 * max(scale, 1e-6), key


def test_a_trained_model_exports_as_transformers_writes_it(case, tmp_path: Path) -> None:
    _, directory, _ = case
    ids = tokens(65, seed=3)
    datum = pg.Datum(model_input=pg.ModelInput.from_ints(ids[:-1]),
                     loss_fn_inputs={"target_tokens": ids[1:]})
    with EngineService(str(directory), thread_tuning=False) as svc:
        trainer = svc.create_training_client()
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(pg.AdamParams(learning_rate=1e-2)).result()
        save_hf_checkpoint(svc.train_model, tmp_path / "export")
        with torch.no_grad():
            ours = svc.train_model(torch.tensor([ids]))[0]
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        theirs = back(torch.tensor([ids])).logits[0].float()
    before = tf.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        assert float((before(torch.tensor([ids])).logits[0] - theirs).abs().max()) > 1e-3
    assert float((ours - theirs).abs().max()) <= 1e-4 * max(float(theirs.abs().max()), 1.0)


def test_in_bf16_the_engine_rounds_near_transformers(tmp_path: Path) -> None:
    directory = tmp_path / "hf"
    save_hf(directory, "starcoder2")
    ids = tokens(129, seed=14)
    hf = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    model = load_model(str(directory), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ours = torch.log_softmax(model(torch.tensor([ids]))[0], -1)[:-1].gather(
            1, torch.tensor(ids[1:])[:, None])[:, 0]
    bound = BF16.logprob_atol(0.0, model.config.n_layers,
                              max_abs_logit(load_model(str(directory)), ids), sides=2)
    assert float((ours - hf_logprobs(hf, ids)).abs().max()) <= bound


def test_lora_is_refused_in_one_line_and_full_training_is_offered(tmp_path: Path) -> None:
    save_hf(tmp_path / "hf", "phi")
    with EngineService(str(tmp_path / "hf"), thread_tuning=False) as svc:
        with pytest.raises(ValueError, match=r"^LoRA is not supported yet for phi, .*full "
                                             r"fine-tuning is \(create_training_client; "
                                             r"--lora-rank 0\)$"):
            svc.create_lora_training_client(rank=4)
        svc.create_training_client()  # and the service is intact


@pytest.mark.parametrize(("arch", "fields", "reason"), [
    ("DeepseekV3", {"num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
     r"deepseek_v3 has keys of width 16 and values of width 8 in 4 heads; prefixgym's KV "
     r"store needs equal widths$"),
])
def test_what_the_kv_store_cannot_hold_is_refused_in_one_line(
        tmp_path: Path, arch: str, fields: dict[str, Any], reason: str) -> None:
    torch.manual_seed(0)
    getattr(tf, f"{arch}ForCausalLM")(getattr(tf, f"{arch}Config")(**{**SHAPE, **fields})
                                      ).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match=reason) as err:
        load_model(str(tmp_path / "hf"))
    assert "\n" not in str(err.value) and str(tmp_path / "hf" / "config.json") in str(err.value)


def test_a_model_type_transformers_does_not_know_is_refused_with_the_families(
        tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "no_such_lm", "hidden_size": 8}')
    with pytest.raises(ValueError, match=r"unsupported model_type 'no_such_lm': neither a "
                                         r"family here \(llama, .*qwen3_moe.*\) nor one "
                                         r"transformers .* knows"):
        load_model(str(tmp_path))
