"""Bad HF checkpoint directories are one-line ValueErrors naming the file: config
fields of the wrong type, truncated safetensors, integer or NaN tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefixgym.engine.model import load_model
from prefixgym.engine.model.hf_config import config_from_hf

CONFIG = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 40, "tie_word_embeddings": True}


def write_checkpoint(directory: Path) -> Path:
    """A Llama directory written by hand (no transformers model needed)."""
    C, F, V, kv = 32, 48, 40, 16
    gen = torch.Generator().manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.1

    tensors = {"model.embed_tokens.weight": t(V, C), "model.norm.weight": torch.ones(C),
               "model.layers.0.input_layernorm.weight": torch.ones(C),
               "model.layers.0.post_attention_layernorm.weight": torch.ones(C),
               "model.layers.0.self_attn.q_proj.weight": t(C, C),
               "model.layers.0.self_attn.k_proj.weight": t(kv, C),
               "model.layers.0.self_attn.v_proj.weight": t(kv, C),
               "model.layers.0.self_attn.o_proj.weight": t(C, C),
               "model.layers.0.mlp.gate_proj.weight": t(F, C),
               "model.layers.0.mlp.up_proj.weight": t(F, C),
               "model.layers.0.mlp.down_proj.weight": t(C, F)}
    (directory / "config.json").write_text(json.dumps(CONFIG))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory / "model.safetensors"


def test_the_hand_written_checkpoint_loads(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    assert load_model(str(tmp_path)).config.dim == 32


@pytest.mark.parametrize(("field", "value"), [
    ("hidden_size", [64]), ("num_hidden_layers", "2"), ("vocab_size", 40.0),
    ("num_key_value_heads", True), ("rms_norm_eps", "1e-6"), ("rope_theta", [1.0]),
    ("max_position_embeddings", {"n": 1}), ("head_dim", 8.5),
])
def test_config_fields_of_the_wrong_type_are_named(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"config\.json: field '{field}' must be"):
        config_from_hf({**CONFIG, field: value}, "dir/config.json")


def test_a_truncated_safetensors_file_is_named(tmp_path: Path) -> None:
    file = write_checkpoint(tmp_path)
    file.write_bytes(file.read_bytes()[:1000])
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: t.to(torch.int32), "has dtype torch.int32"),
    (lambda t: t.index_fill(0, torch.tensor([3]), float("nan")), "holds NaN or inf"),
    (lambda t: t.index_fill(0, torch.tensor([3]), float("inf")), "holds NaN or inf"),
])
def test_integer_or_nonfinite_tensors_are_named(tmp_path: Path, change, message: str) -> None:
    file = write_checkpoint(tmp_path)
    tensors = load_file(str(file))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = change(tensors[name])
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor '{name}' {message}"):
        load_model(str(tmp_path))


def test_values_that_overflow_the_dtype_are_named(tmp_path: Path) -> None:
    file = write_checkpoint(tmp_path)
    tensors = load_file(str(file))
    tensors["model.norm.weight"][0] = 1e6  # finite in fp32, inf in fp16
    save_file(tensors, str(file))
    assert load_model(str(tmp_path)).norm.weight[0] == 1e6
    with pytest.raises(ValueError, match="'model.norm.weight' overflows to inf in torch.float16"):
        load_model(str(tmp_path), dtype=torch.float16)
