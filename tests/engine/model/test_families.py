"""Every model family against transformers' own code, on tiny random-init checkpoints
that transformers saves here (fp32): the engine's logprobs over 256 positions, sampling
with the prefix cache and without it, full-training gradients, a LoRA adapter loaded
into peft on transformers' model, and the export read back by transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from numerics import BF16, max_abs_logit

import prefixgym as pg
from prefixgym.engine.model import load_model
from prefixgym.engine.model.hf_export import hf_state_dict, save_hf_checkpoint
from prefixgym.engine.service import EngineService

peft = pytest.importorskip("peft")

VOCAB = 512
POSITIONS = 256
SHAPE: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2,
                         "vocab_size": VOCAB, "max_position_embeddings": 512,
                         "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2,
                         "pad_token_id": 0}
ROTARY = 8  # head_dim 16: 8 rotated pairs
WINDOW = 48  # a sliding window: the 256 positions span it five times
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "moe_intermediate_size": 32,
       "norm_topk_prob": True}
ALTERNATING = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", {"attention_bias": True}),
    "llama-llama3": ("Llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "llama-linear": ("Llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0,
                                                   "factor": 2.0}}),
    "llama-partial-ignored": ("Llama", {"rope_parameters": {  # transformers rotates all dims
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
    "llama-dynamic": ("Llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4,
                                                    "factor": 2.0}}),
    "llama-yarn": ("Llama", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128}}),
    "llama-longrope": ("Llama", {"max_position_embeddings": 1024, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 320,
        "short_factor": [1.0 + i / 4 for i in range(ROTARY)],
        "long_factor": [3.0] * ROTARY}}),
    "qwen2": ("Qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3", {"head_dim": 32, "tie_word_embeddings": False}),
    "qwen3-window": ("Qwen3", {"use_sliding_window": True, "sliding_window": WINDOW,
                               "max_window_layers": 1}),  # the second layer windowed
    "phi3": ("Phi3", {}),
    "phi3-partial-window": ("Phi3", {"sliding_window": WINDOW, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
    "smollm3": ("SmolLM3", {"no_rope_layers": [1, 0]}),
    "olmo2": ("Olmo2", {}),
    "granite": ("Granite", {"embedding_multiplier": 6.0, "residual_multiplier": 0.5,
                            "attention_multiplier": 0.1, "logits_scaling": 4.0}),
    "mistral": ("Mistral", {"sliding_window": WINDOW, "head_dim": 32}),
    "olmo3": ("Olmo3", {**ALTERNATING, "rope_parameters": {  # yarn on the global layers only
        "full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                           "original_max_position_embeddings": 256},
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}}),
    "gemma2": ("Gemma2", {**ALTERNATING, "head_dim": 16, "query_pre_attn_scalar": 24,
                          "attn_logit_softcapping": 3.0, "final_logit_softcapping": 4.0}),
    "gemma3": ("Gemma3Text", {**ALTERNATING, "head_dim": 16, "query_pre_attn_scalar": 24,
                              "tie_word_embeddings": False, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    "qwen3_moe": ("Qwen3Moe", MOE),
    "qwen3_moe-mixed": ("Qwen3Moe", {**MOE, "norm_topk_prob": False,  # and a dense layer
                                     "mlp_only_layers": [1]}),
    "gpt_oss": ("GptOss", {**ALTERNATING, "num_local_experts": 4, "num_experts_per_tok": 2,
                           "head_dim": 16, "intermediate_size": 32, "swiglu_limit": 0.6,
                           "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4,
                                               "factor": 4.0, "beta_fast": 32.0,
                                               "beta_slow": 1.0, "truncate": False,
                                               "original_max_position_embeddings": 128}}),
}
MODEL_CLASSES = {"Gemma3Text": "Gemma3ForCausalLM", "Qwen3Moe": "Qwen3MoeForCausalLM"}


def save_hf(directory: Path, case: str) -> torch.nn.Module:
    """A tiny random-init checkpoint of the case's family, with norms and biases moved
    off transformers' 1 and 0 so that every weight matters."""
    arch, overrides = CASES[case]
    torch.manual_seed(0)
    config = getattr(tf, f"{arch}Config")(**{**SHAPE, **overrides})
    model = getattr(tf, MODEL_CLASSES.get(arch, f"{arch}ForCausalLM"))(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    return model.eval()


def on_disk(tensors: dict[str, torch.Tensor], case: str) -> dict[str, torch.Tensor]:
    """transformers' tensors named as on disk: Qwen3-MoE's stacked experts in memory,
    one module per expert (gpt-oss keeps them stacked on disk too)."""
    if not case.startswith("qwen3_moe"):
        return tensors
    out = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gates, ups = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gates[e]
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = ups[e]
        elif name.endswith("mlp.experts.down_proj"):
            for e, down in enumerate(t):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = down
        else:
            out[name] = t
    return out


def tokens(n: int = POSITIONS + 1, seed: int = 1) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])
    return logp[:, 0].tolist()


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path, torch.nn.Module]:
    hf = save_hf(tmp_path / "hf", request.param)
    return request.param, tmp_path / "hf", hf


def test_the_engine_gives_transformers_logprobs_cached_or_not(case) -> None:
    name, directory, hf = case
    ids = tokens()
    expected = hf_logprobs(hf, ids)
    assert torch.tensor(expected).std() > 0.1  # not near-constant logprobs
    with EngineService(str(directory), thread_tuning=False) as svc:
        assert svc.train_model.config.family == name.split("-")[0]
        assert any(svc.train_model.config.windows) == (WINDOW in (
            CASES[name][1].get("sliding_window"),))
        sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
        got = sampler.compute_logprobs(ids).result()
        assert got[1:] == pytest.approx(expected, abs=1e-4)
        # a prompt whose first 200 tokens are cached, against the same engine without a cache
        params = pg.SamplingParams(max_tokens=12, temperature=1.0, seed=5)
        sampler.sample(ids[:200], sampling_params=pg.SamplingParams(max_tokens=1)).result()
        cached = sampler.sample(ids[:240], sampling_params=params).result()
    assert cached.usage.prefill_cached_tokens >= 192
    with EngineService(str(directory), thread_tuning=False, prefix_cache=False) as svc:
        plain = svc.create_sampling_client(stop_at_end_of_turn=False).sample(
            ids[:240], sampling_params=params).result()
    assert cached.sequences[0].tokens == plain.sequences[0].tokens
    assert cached.sequences[0].logprobs == pytest.approx(plain.sequences[0].logprobs, abs=1e-5)


def test_training_gradients_are_transformers(case) -> None:
    name, directory, hf = case
    ids = tokens(POSITIONS + 1, seed=2)
    datum = pg.Datum(model_input=pg.ModelInput.from_ints(ids[:-1]),
                     loss_fn_inputs={"target_tokens": ids[1:]})
    with EngineService(str(directory), thread_tuning=False) as svc:
        trainer = svc.create_training_client()
        out = trainer.forward_backward([datum], "cross_entropy").result()
        ours = hf_state_dict(svc.train_model.config,
                             {n: p.grad for n, p in svc.train_model.named_parameters()})
    hf.train()
    logits = hf(torch.tensor([ids[:-1]])).logits[0].float()
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum")
    loss.backward()
    assert out.metrics["loss:sum"] == pytest.approx(float(loss), rel=1e-5)
    theirs = on_disk({n: p.grad for n, p in hf.named_parameters() if p.grad is not None}, name)
    if "lm_head.weight" not in dict(hf.named_parameters()):  # tied: one tensor
        ours.pop("lm_head.weight", None)
    assert sorted(ours) == sorted(theirs)
    for key, grad in theirs.items():
        scale = float(grad.abs().max())
        assert float((ours[key] - grad).abs().max()) <= 1e-4 * max(scale, 1e-6), key


def test_a_lora_adapter_trained_here_loads_into_peft(case, tmp_path: Path) -> None:
    name, directory, hf = case
    if name == "qwen3_moe-mixed":
        pytest.skip("peft 0.21 moves a qwen3_moe adapter's gate_proj/up_proj/down_proj onto "
                    "the experts, so a dense layer's MLP adapter does not load there")
    ids = tokens(80, seed=3)
    datum = pg.Datum(model_input=pg.ModelInput.from_ints(ids[:-1]),
                     loss_fn_inputs={"target_tokens": ids[1:]})
    with EngineService(str(directory), thread_tuning=False) as svc:
        lora = svc.create_lora_training_client(rank=4, alpha=8.0)
        for _ in range(2):  # move B off zero
            lora.forward_backward([datum], "cross_entropy").result()
            lora.optim_step(pg.AdamParams(learning_rate=0.05)).result()
        path = lora.save_weights_for_sampler(tmp_path / "adapter").result()
        ours = lora.save_weights_and_get_sampling_client().compute_logprobs(ids).result()
    base = hf_logprobs(hf, ids)
    theirs = hf_logprobs(peft.PeftModel.from_pretrained(hf, path).eval(), ids)
    assert max(abs(a - b) for a, b in zip(theirs, base)) > 1e-2  # the adapter matters
    assert ours[1:] == pytest.approx(theirs, abs=1e-4)


def test_the_export_is_read_back_by_transformers(case, tmp_path: Path) -> None:
    name, directory, hf = case
    ids = tokens(POSITIONS + 1, seed=4)
    model = load_model(str(directory))
    with torch.no_grad():  # other weights than the checkpoint's: the export carries them
        for p in model.parameters():
            p.mul_(1.1)
    save_hf_checkpoint(model, tmp_path / "export")
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        ours = torch.log_softmax(model(torch.tensor([ids]))[0], -1)[:-1].gather(
            1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert hf_logprobs(back, ids) == pytest.approx(ours, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(ours, hf_logprobs(hf, ids))) > 1e-3


@pytest.mark.parametrize("family, pattern, windows", [
    ("gemma2", None, (WINDOW, 0)), ("gemma3", 2, (WINDOW, 0)), ("gemma3", None, (WINDOW, WINDOW)),
    ("olmo3", None, (WINDOW, WINDOW))])
def test_a_config_without_layer_types_gets_the_familys_pattern(
        tmp_path: Path, family: str, pattern: int | None, windows: tuple[int, ...]) -> None:
    """transformers < 4.54 wrote no `layer_types`: each family's code then picked the
    windowed layers by a fixed pattern (every 2nd layer global, 4th, 6th...)."""
    save_hf(tmp_path, family)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["layer_types"]
    if pattern is not None:
        raw["sliding_window_pattern"] = pattern
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_model(str(tmp_path)).config.windows == windows


def test_experts_tied_in_the_router_are_picked_as_transformers_picks(tmp_path: Path) -> None:
    """Three experts with one router row tie for every token: which two win changes the
    output (their weights differ), and the engine picks as transformers does."""
    hf = save_hf(tmp_path, "qwen3_moe")
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight[1:3] = layer.mlp.gate.weight[0]
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ids = tokens(65, seed=6)
    model = load_model(str(tmp_path)).eval()
    with torch.no_grad():
        ours = torch.log_softmax(model(torch.tensor([ids]))[0], -1)[:-1].gather(
            1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
        probs = torch.softmax(model.layers[0].mlp.router(model.tok_embeddings(
            torch.tensor(ids))), -1)
    assert (probs[:, 0] == probs[:, 1]).all() and (probs[:, 1] == probs[:, 2]).all()
    assert ours == pytest.approx(hf_logprobs(hf, ids), abs=1e-4)


def mxfp4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., R) float rows -> MXFP4 (blocks (..., R/32, 16) uint8, scales (..., R/32)
    uint8): per group of 32, a power of two that brings its largest value within 6, each
    value rounded to the nearest of the 16 4-bit codes, two codes a byte (low first)."""
    from prefixgym.engine.model.hf_checkpoint import FP4_VALUES

    lut = torch.tensor(FP4_VALUES)
    groups = rows.reshape(*rows.shape[:-1], -1, 32)
    exponents = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0))
    codes = (groups / torch.exp2(exponents).unsqueeze(-1)).unsqueeze(-1).sub(lut).abs().argmin(-1)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponents + 127).to(torch.uint8)


def test_gpt_oss_mxfp4_experts_are_dequantized_as_transformers_does(tmp_path: Path) -> None:
    """A checkpoint whose experts are MXFP4 (`_blocks`, `_scales`, as OpenAI ships
    gpt-oss) loads to the weights transformers' own dequantization gives."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = save_hf(tmp_path, "gpt_oss")
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    for i, layer in enumerate(hf.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            blocks, scales = mxfp4(tensors.pop(name).transpose(1, 2))  # rows as stored
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            with torch.no_grad():
                getattr(layer.mlp.experts, proj).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, str(file), metadata={"format": "pt"})
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ids = tokens(129, seed=7)
    model = load_model(str(tmp_path)).eval()
    with torch.no_grad():
        ours = torch.log_softmax(model(torch.tensor([ids]))[0], -1)[:-1].gather(
            1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert ours == pytest.approx(hf_logprobs(hf, ids), abs=1e-4)
    raw["quantization_config"] = {"quant_method": "gptq"}  # any other quantization: refused
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="quant_method 'gptq'"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("chunked_head", [True, False])
def test_the_routers_balancing_loss_is_transformers_when_asked(tmp_path: Path,
                                                              chunked_head: bool) -> None:
    """Off by default; with `router_aux_loss_coef` the loss and the gradients are
    transformers' cross-entropy plus coef x its load-balancing loss, over two datums of
    different lengths (padding left out on both sides, and through the prefix trie)."""
    hf = save_hf(tmp_path / "hf", "qwen3_moe")
    seqs = [tokens(97, seed=8), tokens(60, seed=9)]
    datums = [pg.Datum(model_input=pg.ModelInput.from_ints(s[:-1]),
                       loss_fn_inputs={"target_tokens": s[1:]}) for s in seqs]
    coef = 0.5
    results = {}
    with EngineService(str(tmp_path / "hf"), thread_tuning=False) as svc:
        for name, options in (("off", {}), ("plain", {"share_prefixes": False}),
                              ("trie", {"share_prefixes": True})):
            kwargs = {"chunked_head": chunked_head, **options}
            if name != "off":
                kwargs["router_aux_loss_coef"] = coef
            trainer = svc.create_training_client(**kwargs)
            out = trainer.forward_backward(datums, "cross_entropy").result()
            results[name] = (out.metrics["loss:sum"], hf_state_dict(
                svc.train_model.config, {n: p.grad.clone() for n, p in
                                         svc.train_model.named_parameters()}))
            for p in svc.train_model.parameters():
                p.grad = None
    width = max(len(s) for s in seqs) - 1
    ids = torch.tensor([s[:-1] + [0] * (width - len(s) + 1) for s in seqs])
    mask = torch.tensor([[1] * (len(s) - 1) + [0] * (width - len(s) + 1) for s in seqs])
    hf.train()
    out = hf(ids, attention_mask=mask, output_router_logits=True)
    ce = sum(torch.nn.functional.cross_entropy(out.logits[b, : len(s) - 1].float(),
                                               torch.tensor(s[1:]), reduction="sum")
             for b, s in enumerate(seqs))
    assert results["off"][0] == pytest.approx(float(ce), rel=1e-5)
    total = ce + coef * out.aux_loss
    total.backward()
    theirs = on_disk({n: p.grad for n, p in hf.named_parameters() if p.grad is not None},
                     "qwen3_moe")
    for name in ("plain", "trie"):
        loss, grads = results[name]
        assert loss == pytest.approx(float(total), rel=1e-5), name
        router = "model.layers.0.mlp.gate.weight"
        assert float((grads[router] - results["off"][1][router]).abs().max()) > 1e-4
        for key, grad in theirs.items():
            scale = float(grad.abs().max())
            assert float((grads[key] - grad).abs().max()) <= 1e-4 * max(scale, 1e-6), (name, key)



@pytest.mark.parametrize("case, edit, match", [
    ("mistral", {"sliding_window": 0}, "sliding_window must be at least 1"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention"]},
     "layer_types entry 'chunked_attention'"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default"},
                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "a scaled RoPE on the sliding-window layers"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "experts_per_token in \\[1, 4\\]"),
])
def test_what_a_windowed_or_moe_family_cannot_honour_is_one_line(
        tmp_path: Path, case: str, edit: dict[str, Any], match: str) -> None:
    save_hf(tmp_path, case)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **edit}))
    with pytest.raises(ValueError, match=match):
        load_model(str(tmp_path))


def test_mxfp4_blocks_of_the_wrong_dtype_are_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_hf(tmp_path, "gpt_oss")
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    name = "model.layers.0.mlp.experts.gate_up_proj"
    tensors.pop(name)
    tensors[name + "_blocks"] = torch.zeros(4, 64, 2, 16)  # float, not packed bytes
    tensors[name + "_scales"] = torch.zeros(4, 64, 2, dtype=torch.uint8)
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match="gate_up_proj_blocks' is torch.float32 .* expected "
                                         "torch.uint8"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_a_peft_adapter_on_the_experts_loads_here(tmp_path: Path, case: str) -> None:
    """An adapter peft builds on the stacked experts (`target_parameters`) and attention
    samples here with the logprobs peft gives on transformers' model."""
    hf = save_hf(tmp_path / "hf", case)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             target_parameters=["mlp.experts.gate_up_proj",
                                                "mlp.experts.down_proj"])
    model = peft.get_peft_model(hf, config)
    with torch.no_grad():  # B starts at zero: make every adapter matter
        gen = torch.Generator().manual_seed(11)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.save_pretrained(tmp_path / "adapter")
    ids = tokens(80, seed=12)
    theirs = hf_logprobs(model.eval(), ids)
    with EngineService(str(tmp_path / "hf"), thread_tuning=False) as svc:
        ours = svc.create_sampling_client(model_path=str(tmp_path / "adapter")).compute_logprobs(
            ids).result()
        plain = svc.create_sampling_client().compute_logprobs(ids).result()
    assert max(abs(a - b) for a, b in zip(ours[1:], plain[1:])) > 1e-2
    assert ours[1:] == pytest.approx(theirs, abs=1e-4)


def test_expert_adapters_survive_save_and_load_state(tmp_path: Path) -> None:
    save_hf(tmp_path / "hf", "gpt_oss")
    ids = tokens(40, seed=13)
    datum = pg.Datum(model_input=pg.ModelInput.from_ints(ids[:-1]),
                     loss_fn_inputs={"target_tokens": ids[1:]})
    with EngineService(str(tmp_path / "hf"), thread_tuning=False) as svc:
        plain = svc.create_sampling_client().compute_logprobs(ids).result()
        trainer = svc.create_lora_training_client(rank=4)
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(pg.AdamParams(learning_rate=0.05)).result()
        trainer.save_state(str(tmp_path / "state")).result()
        trained = trainer.save_weights_and_get_sampling_client().compute_logprobs(ids).result()
        again = svc.create_lora_training_client(rank=4, seed=99)
        again.load_state(str(tmp_path / "state")).result()
        loaded = again.save_weights_and_get_sampling_client().compute_logprobs(ids).result()
    assert loaded == trained
    assert max(abs(a - b) for a, b in zip(loaded[1:], plain[1:])) > 1e-3


def test_in_bf16_the_engine_rounds_near_transformers(case) -> None:
    """Loaded in bf16 on both sides: logprobs within two bf16 computations' bound
    (tests/numerics.py; they are equal to the bit on this machine's AMX kernels, where
    OLMo's fp32 RoPE and norms and gpt-oss's roundings are copied)."""
    name, directory, _ = case
    ids = tokens(129, seed=14)
    hf = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    model = load_model(str(directory), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ours = torch.log_softmax(model(torch.tensor([ids]))[0], -1)[:-1].gather(
            1, torch.tensor(ids[1:])[:, None])[:, 0]
    theirs = torch.tensor(hf_logprobs(hf, ids))
    bound = BF16.logprob_atol(0.0, model.config.n_layers,
                              max_abs_logit(load_model(str(directory)), ids), sides=2)
    assert float((ours - theirs).abs().max()) <= bound
