"""save_hf_checkpoint: our model as an HF directory that load_hf_checkpoint reads back exactly."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from prefixgym.engine.model import PRESETS, Transformer, init_weights, load_model
from prefixgym.engine.model.hf_checkpoint import load_hf_checkpoint
from prefixgym.engine.model.hf_export import save_hf_checkpoint


@pytest.mark.parametrize("biases", [(False, False), (True, False), (True, True)])
def test_round_trip_is_exact(tmp_path, biases) -> None:
    qkv_bias, out_bias = biases
    config = dataclasses.replace(PRESETS["tiny"], qkv_bias=qkv_bias, out_bias=out_bias,
                                 tie_embeddings=qkv_bias and not out_bias)
    model = Transformer(config)
    init_weights(model, seed=3)
    with torch.no_grad():  # init_weights zeroes biases: make them visible
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    save_hf_checkpoint(model, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == ("qwen2" if qkv_bias and not out_bias else "llama")
    back = load_hf_checkpoint(tmp_path / "hf")
    # the same config, whose family names the layout written (Qwen2's for q/k/v biases alone)
    assert back.config == dataclasses.replace(model.config, family=cfg["model_type"])
    want = model.state_dict()
    got = back.state_dict()
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_a_second_save_replaces_the_first(tmp_path) -> None:
    save_hf_checkpoint(load_model("tiny", seed=1), tmp_path / "hf")
    model = load_model("tiny", seed=2)
    save_hf_checkpoint(model, tmp_path / "hf")
    back = load_hf_checkpoint(tmp_path / "hf")
    assert torch.equal(back.state_dict()["norm.weight"], model.state_dict()["norm.weight"])
    assert torch.equal(back.state_dict()["layers.0.attn.wqkv.weight"],
                       model.state_dict()["layers.0.attn.wqkv.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary left behind
