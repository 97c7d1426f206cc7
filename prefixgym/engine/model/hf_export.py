"""Write the built-in `Transformer` as a Hugging Face checkpoint directory.

The inverse of `hf_checkpoint.load_hf_checkpoint`: config.json (the one the model was
loaded from, as it was; for a preset, Llama's, or Qwen2's for a model with q/k/v
biases and no output bias) and one model.safetensors whose tensors carry the family's
HF names, our fused projections split back into its modules (`families.py`). This is
what an inference server loads full weights from (SGLang's
`/update_weights_from_disk` takes such a directory, and so does `prefixgym serve`);
`load_hf_checkpoint(save_hf_checkpoint(model, d))` gives back the same tensors.

The directory is written atomically (`prefixgym.files`): a reader sees the previous
one or the whole new one. This module knows tensor names and config fields; it
writes no tokenizer and no training state (those are `checkpoint_io`'s).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path

import safetensors.torch
import torch

from prefixgym.engine.model.config import ModelConfig
from prefixgym.engine.model.decoder import Transformer
from prefixgym.engine.model.families import (
    EXPERT_MODULES,
    LAYERS,
    block_norms,
    family_named,
    module_shapes,
)
from prefixgym.engine.model.hf_checkpoint import interleave_gate_up
from prefixgym.engine.model.hf_fallback import TransformersCodeModel
from prefixgym.files import write_dir_atomically

__all__ = ["hf_config", "hf_state_dict", "save_hf_checkpoint"]


def hf_config(model: Transformer) -> dict[str, object]:
    """The config.json `hf_config.config_from_hf` reads back into this model's config: the
    one it was loaded from (its dtype brought up to date), or one written for a preset."""
    dtype = str(model.tok_embeddings.weight.dtype).removeprefix("torch.")
    if model.hf_config is not None:  # (its experts are written dense: MXFP4 is not kept)
        loaded = {k: v for k, v in model.hf_config.items() if k != "quantization_config"}
        return {**loaded, "dtype": dtype,
                **({"torch_dtype": dtype} if "torch_dtype" in model.hf_config else {})}
    cfg = model.config
    plain = dataclasses.replace(  # the fields a Llama/Qwen2 config.json below writes
        ModelConfig(cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                    cfg.hidden_dim), max_seq_len=cfg.max_seq_len, rope_theta=cfg.rope_theta,
        norm_eps=cfg.norm_eps, tie_embeddings=cfg.tie_embeddings, qkv_bias=cfg.qkv_bias,
        out_bias=cfg.out_bias, head_dim_override=cfg.head_dim_override,
        family=cfg.family) == cfg and family_named(cfg.family).plain
    if not plain:
        raise ValueError(f"this {cfg.family} model has no config.json to write back (it was "
                         "not loaded from a checkpoint directory), and a Llama/Qwen2 one "
                         "would not describe it")
    qwen2 = cfg.qkv_bias and not cfg.out_bias
    family = family_named("qwen2" if qwen2 else "llama")
    out: dict[str, object] = {
        "architectures": [family.architecture],
        "model_type": family.model_types[0],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.hidden_dim,
        "max_position_embeddings": cfg.max_seq_len, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", "rope_scaling": None,
        "torch_dtype": dtype,
    }
    if not qwen2:
        out["attention_bias"] = cfg.qkv_bias
    if cfg.head_dim_override is not None:
        out["head_dim"] = cfg.head_dim_override
    return out


def hf_state_dict(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
    """Tensors named as our state dict (weights, or their gradients) -> the family's HF
    names, our fused rows split into its modules (every tensor a contiguous CPU copy)."""
    sd = {k: v.detach().to("cpu") for k, v in tensors.items()}
    out = {
        "model.embed_tokens.weight": sd["tok_embeddings.weight"],
        "model.norm.weight": sd["norm.weight"],
    }
    biased = {"attn.wqkv": cfg.qkv_bias, "attn.wo": cfg.out_bias}
    for i in range(cfg.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        for norm, hf_norm in block_norms(cfg):
            out[hf + hf_norm + ".weight"] = sd[ours + norm + ".weight"]
        moe = cfg.is_moe(i)
        if moe:
            experts = _gpt_oss_experts if family_named(cfg.family).experts == "interleaved" \
                else _experts
            out.update(experts(sd, ours + "mlp.", hf + "mlp.", cfg))
        if cfg.attention_sinks:
            out[hf + "self_attn.sinks"] = sd[ours + "attn.sinks"]
        for layer in LAYERS:
            if moe and layer.startswith("mlp."):
                continue
            parts = module_shapes(cfg, layer)
            widths = [shape[0] for _, shape in parts]
            for kind in ("weight", "bias") if biased.get(layer) else ("weight",):
                pieces = sd[ours + f"{layer}.{kind}"].split(widths)
                for (module, _), piece in zip(parts, pieces, strict=True):
                    out[hf + f"{module}.{kind}"] = piece
        for which in ("q_norm", "k_norm") if cfg.qk_norm != "none" else ():
            out[hf + f"self_attn.{which}.weight"] = sd[ours + f"attn.{which}.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["output.weight"]
    return {k: v.contiguous().clone() for k, v in out.items()}


def _experts(sd: Mapping[str, torch.Tensor], ours: str, hf: str, cfg: ModelConfig
             ) -> dict[str, torch.Tensor]:
    """One mixture's router and experts, one module per expert (transformers' layout on
    disk)."""
    gate, up, down = EXPERT_MODULES
    out = {hf + "gate.weight": sd[ours + "router.weight"]}
    for e in range(cfg.num_experts):
        g, u = sd[ours + "w_gate_up"][e].chunk(2)
        out[f"{hf}experts.{e}.{gate}.weight"] = g
        out[f"{hf}experts.{e}.{up}.weight"] = u
        out[f"{hf}experts.{e}.{down}.weight"] = sd[ours + "w_down"][e]
    return out


def _gpt_oss_experts(sd: Mapping[str, torch.Tensor], ours: str, hf: str, cfg: ModelConfig
                     ) -> dict[str, torch.Tensor]:
    """gpt-oss's router and experts, dense, as transformers holds them: (E, C, 2F) with
    gate and up interleaved, (E, F, C), and their biases."""
    return {hf + "router.weight": sd[ours + "router.weight"],
            hf + "router.bias": sd[ours + "router.bias"],
            hf + "experts.gate_up_proj": interleave_gate_up(sd[ours + "w_gate_up"]).transpose(1, 2),
            hf + "experts.gate_up_proj_bias": interleave_gate_up(sd[ours + "b_gate_up"]),
            hf + "experts.down_proj": sd[ours + "w_down"].transpose(1, 2),
            hf + "experts.down_proj_bias": sd[ours + "b_down"]}


def save_hf_checkpoint(model: Transformer, directory: str | os.PathLike[str]) -> Path:
    """Write `model`'s current weights into `directory` (replaced atomically); returns it.
    A model run by transformers' code (hf_fallback.py) is written by transformers."""
    target = Path(directory)
    if isinstance(model, TransformersCodeModel):
        def written_by_transformers(tmp: Path) -> None:
            tmp.chmod(0o755)
            model.save_pretrained(tmp)

        write_dir_atomically(target, written_by_transformers)
        return target
    tensors = hf_state_dict(model.config, model.state_dict())
    config = json.dumps(hf_config(model), indent=2) + "\n"

    def fill(tmp: Path) -> None:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from a server running as another user
        (tmp / "config.json").write_text(config)
        safetensors.torch.save_file(tensors, str(tmp / "model.safetensors"),
                                    metadata={"format": "pt"})

    write_dir_atomically(target, fill)
    return target
