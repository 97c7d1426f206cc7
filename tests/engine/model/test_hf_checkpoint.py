"""Loading local HF Llama/Qwen2 checkpoints: logits equal to transformers' own, and
clear errors for directories we cannot load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from prefixgym.engine.model import load_model
from prefixgym.engine.model.hf_config import config_from_hf

VOCAB = 300
SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "initializer_range": 0.2,
}


def save_hf(directory: Path, kind: str, **overrides: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        model: torch.nn.Module = LlamaForCausalLM(LlamaConfig(**{**SHAPE, **overrides}))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**{**SHAPE, **overrides}))
    with torch.no_grad():  # non-trivial norms and biases (HF inits them to 1 and 0)
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    return model.eval()


CASES = {
    "llama_gqa": ("llama", {}),
    "llama_attention_bias": ("llama", {"attention_bias": True, "rope_theta": 500.0}),
    "llama_head_dim": ("llama", {"head_dim": 32}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2_untied": ("qwen2", {"tie_word_embeddings": False, "rms_norm_eps": 1e-5}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case: str, tmp_path: Path) -> None:
    kind, overrides = CASES[case]
    hf = save_hf(tmp_path, kind, **overrides)
    ours = load_model(str(tmp_path))
    assert ours.config.n_kv_heads == 2 and ours.config.vocab_size == VOCAB
    assert ours.config.tie_embeddings == bool(overrides.get("tie_word_embeddings", False))
    tokens = torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits.float()
        got = ours(tokens)
    assert expected.std() > 0.1  # the comparison is not between near-constant logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert all(p.requires_grad for p in ours.parameters())


def test_back_to_back_parts_are_one_view_of_the_file(tmp_path: Path) -> None:
    save_hf(tmp_path, "llama", attention_bias=True)
    file = tmp_path / "model.safetensors"
    stored = load_file(str(file))
    ours = load_model(str(tmp_path))
    for i, block in enumerate(ours.layers):
        hf = f"model.layers.{i}."
        gate_up = block.mlp.w_gate_up.weight
        assert torch.equal(gate_up, torch.cat([stored[hf + "mlp.gate_proj.weight"],
                                               stored[hf + "mlp.up_proj.weight"]]))
        assert gate_up.untyped_storage().nbytes() == file.stat().st_size  # no copy
        for kind in ("weight", "bias"):  # k_proj sorts first: not in our order, copied
            qkv = getattr(block.attn.wqkv, kind)
            assert torch.equal(qkv, torch.cat([stored[f"{hf}self_attn.{m}_proj.{kind}"]
                                               for m in "qkv"]))
            assert qkv.untyped_storage().nbytes() == qkv.nbytes
    converted = load_model(str(tmp_path), dtype=torch.bfloat16)  # a copy, converted
    assert torch.equal(converted.layers[0].mlp.w_gate_up.weight, torch.cat(
        [stored[f"model.layers.0.mlp.{m}_proj.weight"] for m in ("gate", "up")]).bfloat16())


def test_bfloat16_load_is_finite_and_close(tmp_path: Path) -> None:
    save_hf(tmp_path, "qwen2")
    ref = load_model(str(tmp_path))
    bf16 = load_model(str(tmp_path), dtype=torch.bfloat16)
    assert bf16.tok_embeddings.weight.dtype == torch.bfloat16
    tokens = torch.randint(0, VOCAB, (1, 16))
    with torch.no_grad():
        expected, got = ref(tokens), bf16(tokens)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    drift = (expected - got).abs().max().item()
    print(f"bf16 vs fp32 max logit drift (qwen2 test model): {drift:.4f}")
    assert drift < 0.1 * expected.abs().max().item() + 0.05


def test_max_seq_len_defaults_to_capped_max_position_embeddings(tmp_path: Path) -> None:
    save_hf(tmp_path, "llama", max_position_embeddings=512)
    assert load_model(str(tmp_path)).config.max_seq_len == 512
    assert load_model(str(tmp_path), max_seq_len=64).config.max_seq_len == 64
    assert (
        config_from_hf(
            {
                **json.loads((tmp_path / "config.json").read_text()),
                "max_position_embeddings": 131072,
            }
        ).max_seq_len
        == 32768
    )


def test_legacy_config_layout_reads_top_level_rope_theta() -> None:
    raw = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 300,
        "rope_theta": 1234.0,
        "rope_scaling": None,
    }
    config = config_from_hf(raw)
    assert config.rope_theta == 1234.0
    assert config.n_kv_heads == 4  # num_key_value_heads absent: plain multi-head attention


def edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"model_type": "gpt2"}, "does not fit transformers' gpt2 model: 28 missing keys"),
        ({"model_type": "no_such_lm"}, "unsupported model_type 'no_such_lm': neither"),
        ({"rope_parameters": None, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
         "rope_scaling of type 'llama3' needs 'original_max_position_embeddings'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
         "rope_parameters of type 'yarn' needs 'original_max_position_embeddings'"),
        ({"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}},
         "unsupported rope_parameters type 'su'"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0: soft-capping is not "
                                           "supported for llama"),
        ({"layer_types": ["chunked_attention", "full_attention"]},
         "layer_types entry 'chunked_attention' is not supported"),
        ({"layer_types": ["full_attention"]}, "layer_types must be a list of 2 strings"),
        ({"use_bidirectional_attention": True}, "bidirectional attention"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"hidden_size": None}, "'hidden_size' is missing"),
        ({"num_key_value_heads": 3}, "multiple of n_kv_heads"),
        ({"intermediate_size": 100}, "mlp.gate_proj.weight' has shape"),
    ],
)
def test_unsupported_or_inconsistent_config_is_a_clear_error(
    tmp_path: Path, changes: dict[str, Any], match: str
) -> None:
    save_hf(tmp_path, "llama")
    edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=match):
        load_model(str(tmp_path))


def test_qwen2_windows_only_with_use_sliding_window(tmp_path: Path) -> None:
    """Qwen2's code windows the layers from `max_window_layers` on, and only with
    `use_sliding_window` (its config nulls the window otherwise)."""
    save_hf(tmp_path, "qwen2")
    edit_config(tmp_path, sliding_window=8, max_window_layers=1, layer_types=None)
    assert load_model(str(tmp_path)).config.windows == (0, 0)
    edit_config(tmp_path, use_sliding_window=True)
    assert load_model(str(tmp_path)).config.windows == (0, 8)


def test_missing_config_or_weights_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(str(tmp_path))
    save_hf(tmp_path, "llama")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(str(tmp_path))


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    save_hf(tmp_path, "llama")
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match="'model.layers.1.self_attn.v_proj.weight' is missing"):
        load_model(str(tmp_path))


def test_untied_checkpoint_without_lm_head_is_refused(tmp_path: Path) -> None:
    save_hf(tmp_path, "qwen2", tie_word_embeddings=True)
    edit_config(tmp_path, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="'lm_head.weight' is missing"):
        load_model(str(tmp_path))


def test_loading_hands_freed_temporaries_back_once(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from prefixgym.engine import malloc_tuning

    save_hf(tmp_path, "qwen2")
    calls: list[None] = []
    monkeypatch.setattr(malloc_tuning, "release_free_memory", lambda: calls.append(None) or True)
    model = load_model(str(tmp_path))
    assert len(calls) == 1
    assert model.config.n_layers == 2  # the model itself is intact
