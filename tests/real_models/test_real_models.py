"""Real pretrained checkpoints, loaded from their GGUF files as a user's `--model
FILE.gguf` loads them (real_checkpoints.py: which models, and how they get here): our
decoder against transformers' on the same converted weights (teacher-forced logprobs
in fp32, and a bf16 trainer within bf16's bound), sampling from the prefix cache
against computing the prompt, a LoRA adapter read back by peft, and GRPO steps through
`prefixgym train` that run and checkpoint."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers as tf
from numerics import BF16
from real_checkpoints import MODELS, RealModel, model_params, real_models_skip_reason

import prefixgym as pg
from prefixgym.cli.train import train
from prefixgym.cli.train_args import parse_train_config
from prefixgym.engine.model.gguf_import import SOURCE_FILE, checkpoint_dir_of
from prefixgym.local_service import LocalService

TEXT = ("The history of the bicycle begins in the early nineteenth century, when inventors "
        "in Germany and France built wooden machines that riders pushed along with their "
        "feet. Pedals came later, and with them the long road to the modern bicycle.")
OTHER_TEXT = "Water boils at one hundred degrees Celsius at sea level, and at lower"
GEMMA_TEMPLATE = (  # Gemma's turns; the base model's GGUF file carries no template
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else 'user' }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@dataclass
class Loaded:
    name: str
    model: RealModel
    directory: Path  # the converted Hugging Face directory
    service: LocalService
    hf: torch.nn.Module  # transformers' model of the same directory, fp32, eval


@pytest.fixture(scope="module", params=model_params(*MODELS))
def real(request: pytest.FixtureRequest) -> Iterator[Loaded]:
    model = MODELS[request.param]
    if (reason := real_models_skip_reason(model)) is not None:
        pytest.skip(reason)
    service = LocalService(model=str(model.path), thread_tuning=False)
    directory = checkpoint_dir_of(model.path)
    hf = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    yield Loaded(request.param, model, directory, service, hf)
    service.close()


def hf_logprobs(model: torch.nn.Module, ids: list[int]) -> tuple[list[float], float]:
    """transformers' teacher-forced logprobs of `ids[1:]`, and max|logit|."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])
    return logp[:, 0].tolist(), float(logits.abs().max())


def test_the_gguf_file_loads_as_our_decoder_with_its_tokenizer(real: Loaded) -> None:
    svc, model = real.service, real.model
    assert svc.train_model.config.family == model.family  # our code, not the fallback
    assert svc.train_model.config.n_layers == model.n_layers
    assert svc.train_model.config.vocab_size >= len(svc.tokenizer)
    assert bool(svc.tokenizer.chat_template) == model.has_template
    source = json.loads((real.directory / SOURCE_FILE).read_text())
    with open(model.path, "rb") as f:
        assert source["sha256"] == hashlib.file_digest(f, "sha256").hexdigest()
    ids = svc.tokenizer.encode(TEXT)
    assert svc.tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert checkpoint_dir_of(model.path) == real.directory  # the second load converts nothing


def test_teacher_forced_logprobs_are_transformers_in_fp32_and_bf16(real: Loaded) -> None:
    ids = real.service.tokenizer.encode(TEXT)
    theirs, max_logit = hf_logprobs(real.hf, ids)
    ours = real.service.create_sampling_client().compute_logprobs(ids).result()
    assert ours[0] is None and ours[1:] == pytest.approx(theirs, abs=1e-4)
    # a bf16 trainer (LoRA at init: the base model's logprobs) against transformers' fp32
    bf16 = real.service.create_lora_training_client(rank=1, compute_dtype=torch.bfloat16)
    datum = pg.Datum(model_input=pg.ModelInput.from_ints(ids[:-1]),
                     loss_fn_inputs={"target_tokens": ids[1:]})
    out = bf16.forward([datum], "cross_entropy").result()
    got = torch.tensor(out.loss_fn_outputs[0]["logprobs"])
    bound = BF16.logprob_atol(0.0, real.model.n_layers, max_logit)
    assert float((got - torch.tensor(theirs)).abs().max()) <= bound
    assert float((got - torch.tensor(theirs)).abs().mean()) > 0  # it did round in bf16


def test_sampling_from_the_prefix_cache_gives_the_tokens_computed_without_it(
        real: Loaded) -> None:
    sampler = real.service.create_sampling_client(stop_at_end_of_turn=False)
    ids = real.service.tokenizer.encode(OTHER_TEXT)
    params = pg.SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    fresh = sampler.sample(pg.ModelInput.from_ints(ids), num_samples=2,
                           sampling_params=params).result()
    cached = sampler.sample(pg.ModelInput.from_ints(ids), num_samples=2,
                            sampling_params=params).result()
    # (the first block may be cached already: another test's prompt began with BOS too)
    assert cached.usage.prefill_cached_tokens >= len(ids) // 2 > fresh.usage.prefill_cached_tokens
    for a, b in zip(fresh.sequences, cached.sequences, strict=True):
        assert a.tokens == b.tokens
        # fp32 sums in another order over 18-30 layers: 1.7e-5 apart measured
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    real.service.check_cache_integrity()


def test_a_base_model_without_a_template_is_told_how_to_give_one(real: Loaded,
                                                                 tmp_path: Path) -> None:
    if real.model.has_template:
        pytest.skip("this model's GGUF file has a chat template")
    argv = ["--model", str(real.model.path), "--env", "tests/Lengthy-v0", "--out",
            str(tmp_path / "run")]
    with pytest.raises(ValueError, match=r"has no chat template .*--chat-template FILE"):
        train(parse_train_config(argv), service=real.service)


def test_a_lora_adapter_trained_here_loads_into_peft(real: Loaded, tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    ids = real.service.tokenizer.encode(TEXT)
    datum = pg.Datum(model_input=pg.ModelInput.from_ints(ids[:-1]),
                     loss_fn_inputs={"target_tokens": ids[1:]})
    lora = real.service.create_lora_training_client(rank=4, alpha=8.0)
    for _ in range(2):  # move B off zero
        lora.forward_backward([datum], "cross_entropy").result()
        lora.optim_step(pg.AdamParams(learning_rate=1e-3)).result()
    path = lora.save_weights_for_sampler(tmp_path / "adapter").result()
    ours = lora.save_weights_and_get_sampling_client().compute_logprobs(ids).result()
    base, _ = hf_logprobs(real.hf, ids)
    adapted = peft.PeftModel.from_pretrained(real.hf, path).eval()
    try:
        theirs, _ = hf_logprobs(adapted, ids)
    finally:
        adapted.unload()  # the shared transformers model, without the adapter again
    assert max(abs(a - b) for a, b in zip(theirs, base)) > 1e-3  # the adapter matters
    assert ours[1:] == pytest.approx(theirs, abs=1e-4)


def test_grpo_steps_run_and_checkpoint(real: Loaded, tmp_path: Path) -> None:
    out = tmp_path / "run"
    template: list[str] = []
    if not real.model.has_template:
        (tmp_path / "chat.jinja").write_text(GEMMA_TEMPLATE)
        template = ["--chat-template", str(tmp_path / "chat.jinja")]
    argv = [*template, "--model", str(real.model.path), "--env", "tests/Lengthy-v0", "--steps", "2",
            "--groups-per-step", "1", "--group-size", "4", "--max-tokens", "4",
            "--eval-episodes", "2", "--lora-rank", "4", "--compute-dtype", "float32",
            "--checkpoint-every", "1", "--no-progress", "--out", str(out)]
    config = parse_train_config(argv)
    assert config.lr == 2e-4 and config.sft_steps == 0  # the pretrained-model defaults
    train(config, service=real.service)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["phase"] == "grpo"] == [0, 1]
    # a group whose replies all score alike trains nothing (Gemma's base model can write
    # four replies of one length); a step whose group differs trains its sampled tokens
    grpo = [r for r in records if r["phase"] == "grpo"]
    assert all(r["tokens/sampled"] > 0 for r in grpo)
    assert any(r["tokens/train_loss"] > 0 for r in grpo)
    assert (out / "checkpoints" / "latest").read_text() == "step-000001"
    assert (out / "adapter" / "adapter_config.json").is_file()
