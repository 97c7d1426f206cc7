"""Write the built-in `Transformer` as a Hugging Face Llama/Qwen2 checkpoint directory.

The inverse of `hf_checkpoint.load_hf_checkpoint`: config.json (Llama, or Qwen2 for a
model with q/k/v biases and no output bias) and one model.safetensors whose tensors
carry HF names, our fused projections split back into q/k/v and gate/up. This is
what an inference server loads full weights from (SGLang's
`/update_weights_from_disk` takes such a directory, and so does `prefixgym serve`);
`load_hf_checkpoint(save_hf_checkpoint(model, d))` gives back the same tensors.

The directory is written atomically (`prefixgym.files`): a reader sees the previous
one or the whole new one. This module knows tensor names and config fields; it
writes no tokenizer and no training state (those are `checkpoint_io`'s).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import safetensors.torch
import torch

from prefixgym.engine.model.decoder import Transformer
from prefixgym.files import write_dir_atomically

__all__ = ["hf_config", "save_hf_checkpoint"]


def hf_config(model: Transformer) -> dict[str, object]:
    """The config.json fields `hf_checkpoint.config_from_hf` reads back into our config."""
    cfg = model.config
    qwen2 = cfg.qkv_bias and not cfg.out_bias
    out: dict[str, object] = {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.hidden_dim,
        "max_position_embeddings": cfg.max_seq_len, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", "rope_scaling": None,
        "torch_dtype": str(model.tok_embeddings.weight.dtype).removeprefix("torch."),
    }
    if not qwen2:
        out["attention_bias"] = cfg.qkv_bias
    if cfg.head_dim_override is not None:
        out["head_dim"] = cfg.head_dim_override
    return out


def _hf_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """Our fused layout -> HF names (every tensor a contiguous CPU copy)."""
    cfg = model.config
    sd = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    q_out = cfg.n_heads * cfg.head_dim
    kv_out = cfg.n_kv_heads * cfg.head_dim
    out = {
        "model.embed_tokens.weight": sd["tok_embeddings.weight"],
        "model.norm.weight": sd["norm.weight"],
    }
    for i in range(cfg.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        out[hf + "input_layernorm.weight"] = sd[ours + "attn_norm.weight"]
        out[hf + "post_attention_layernorm.weight"] = sd[ours + "mlp_norm.weight"]
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            q, k, v = sd[ours + f"attn.wqkv.{kind}"].split([q_out, kv_out, kv_out])
            out[hf + f"self_attn.q_proj.{kind}"] = q
            out[hf + f"self_attn.k_proj.{kind}"] = k
            out[hf + f"self_attn.v_proj.{kind}"] = v
        out[hf + "self_attn.o_proj.weight"] = sd[ours + "attn.wo.weight"]
        if cfg.out_bias:
            out[hf + "self_attn.o_proj.bias"] = sd[ours + "attn.wo.bias"]
        gate, up = sd[ours + "mlp.w_gate_up.weight"].split([cfg.hidden_dim, cfg.hidden_dim])
        out[hf + "mlp.gate_proj.weight"] = gate
        out[hf + "mlp.up_proj.weight"] = up
        out[hf + "mlp.down_proj.weight"] = sd[ours + "mlp.w_down.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["output.weight"]
    return {k: v.contiguous().clone() for k, v in out.items()}


def save_hf_checkpoint(model: Transformer, directory: str | os.PathLike[str]) -> Path:
    """Write `model`'s current weights into `directory` (replaced atomically); returns it."""
    target = Path(directory)
    tensors = _hf_tensors(model)
    config = json.dumps(hf_config(model), indent=2) + "\n"

    def fill(tmp: Path) -> None:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from a server running as another user
        (tmp / "config.json").write_text(config)
        safetensors.torch.save_file(tensors, str(tmp / "model.safetensors"),
                                    metadata={"format": "pt"})

    write_dir_atomically(target, fill)
    return target
