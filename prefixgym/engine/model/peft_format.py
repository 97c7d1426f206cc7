"""LoRA adapters in PEFT's format: adapter_config.json + adapter_model.safetensors.

Names are the model family's Hugging Face module names as PEFT saves them for a causal
LM (`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`; presets have the
Llama architecture). Our fused projections are split into the family's modules
(`families.py`: q/k/v and gate/up, or Phi-3's fused qkv_proj and gate_up_proj) on save
and joined on load; a part or layer the file has no adapter for gets a zero one
(PEFT's common `target_modules=["q_proj", "v_proj"]` loads).

1) `save_adapter` writes the two files into a directory, atomically (the directory
   appears whole or not at all).
2) `read_adapter` checks a directory (config fields we cannot compute exactly are
   refused: DoRA, trained biases, modules_to_save, per-module ranks or alphas; every
   tensor name and shape is checked against the model) and returns the `LoraSpec`
   and our adapters' (A, B) tensors, ready for `load_into`.

This module knows PEFT's file layout and HF names; it builds no models (`lora.py`
does) and does not sample or train.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from prefixgym.engine.model.config import ModelConfig
from prefixgym.engine.model.decoder import Transformer
from prefixgym.engine.model.families import LAYERS, family_named, module_shapes
from prefixgym.engine.model.hf_checkpoint import deinterleave_gate_up, interleave_gate_up
from prefixgym.engine.model.lora import HEAD, ExpertLora, LoraSpec, lora_adapters
from prefixgym.files import write_dir_atomically, write_text_atomically

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "load_into", "read_adapter", "save_adapter"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model."
Tensor = torch.Tensor

_KEY = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(\w+\.\w+)\.lora_([AB])\.weight$")
_HEAD_KEY = re.compile(r"^base_model\.model\.lm_head\.lora_([AB])\.weight$")
_BASE_COPIES = {  # base weights PEFT saves along when lm_head or the embedding is targeted
    "base_model.model.lm_head.base_layer.weight", "base_model.model.lm_head.weight",
    "base_model.model.model.embed_tokens.weight",
    "base_model.model.model.embed_tokens.base_layer.weight",
}


def _hf_modules(key: str, model: Transformer) -> tuple[str, ...]:
    if key == HEAD:
        return ("lm_head",)
    _, i, layer = key.split(".", 2)
    return tuple(f"model.layers.{i}.{name}"
                 for name in family_named(model.config.family).hf_modules(layer))


EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
"""PEFT's `target_parameters` of a mixture's experts. PEFT nests its wrappers in the
order the experts module defines the parameters, gate/up first: gate/up's adapter is
`experts.base_layer.lora_*`, down's `experts.lora_*`, whatever order the list in its
adapter_config.json has (peft 0.21 writes it in either, run to run)."""
_EXPERT_KEY = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.mlp\.experts\.(base_layer\.)?"
    r"lora_([AB])\.weight$")


def _expert_tensors(adapter: ExpertLora, interleaved: bool) -> dict[str, tuple[Tensor, Tensor]]:
    """Our per-expert A (E, r, in) and B (E, out, r) -> PEFT's (r * E, in) A, expert by
    expert, and (out, r * E) B, rank by rank (`ParamWrapper`'s layout); gpt-oss's gate/up
    rows interleaved as its checkpoints hold them."""
    out = {}
    for which, a, b in (("gate_up", adapter.gate_up_A, adapter.gate_up_B),
                        ("down", adapter.down_A, adapter.down_B)):
        E, r, fan_in = a.shape
        rows = b.detach()
        if which == "gate_up" and interleaved:
            rows = interleave_gate_up(rows)
        out[which] = (a.detach().reshape(E * r, fan_in),
                      rows.permute(1, 2, 0).reshape(rows.shape[1], r * E))
    return out


def _interleaved(model: Transformer) -> bool:
    return family_named(model.config.family).experts == "interleaved"


def save_adapter(directory: str | os.PathLike[str], model: Transformer, spec: LoraSpec,
                 base_model: str = "") -> str:
    """Write `model`'s adapters into `directory` (replaced whole); return its absolute path."""
    tensors: dict[str, Tensor] = {}
    targets: set[str] = set()
    experts = False
    for key, adapter in lora_adapters(model).items():
        if isinstance(adapter, ExpertLora):
            experts = True
            where = f"{PREFIX}model.{key}.experts."
            pairs = _expert_tensors(adapter, _interleaved(model))
            for which, prefix in (("gate_up", where + "base_layer."), ("down", where)):
                tensors[prefix + "lora_A.weight"] = pairs[which][0].float().cpu().contiguous()
                tensors[prefix + "lora_B.weight"] = pairs[which][1].float().cpu().contiguous()
            continue
        r, row = adapter.rank, 0
        for p, (name, width) in enumerate(zip(_hf_modules(key, model), adapter.parts, strict=True)):
            a = adapter.lora_A.detach()[p * r : (p + 1) * r]
            b = adapter.lora_B.detach()[row : row + width]
            tensors[f"{PREFIX}{name}.lora_A.weight"] = a.float().cpu().contiguous()
            tensors[f"{PREFIX}{name}.lora_B.weight"] = b.float().cpu().contiguous()
            targets.add(name.rsplit(".", 1)[-1])
            row += width
    config: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": 0.0,
        "target_modules": sorted(targets), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": spec.rslora, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True, "rank_pattern": {},
        "alpha_pattern": {}, "layers_to_transform": None,
        **({"target_parameters": list(EXPERT_PARAMETERS)} if experts else {}),
    }
    target = Path(directory).absolute()

    def fill(tmp: Path) -> None:
        safetensors.torch.save_file(tensors, str(tmp / WEIGHTS_NAME),
                                    metadata={"format": "pt"})
        write_text_atomically(tmp / CONFIG_NAME, json.dumps(config, indent=2) + "\n")

    write_dir_atomically(target, fill)
    return str(target)


def _read_config(root: Path) -> dict[str, Any]:
    path = root / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{root}: no {CONFIG_NAME} (not a PEFT adapter directory)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object")  # noqa: TRY004
    refusals = {
        "peft_type": (cfg.get("peft_type") != "LORA", "only LoRA adapters load"),
        "use_dora": (bool(cfg.get("use_dora")), "DoRA is not supported"),
        "bias": (cfg.get("bias", "none") != "none", "trained biases are not supported"),
        "modules_to_save": (bool(cfg.get("modules_to_save")), "modules_to_save is not supported"),
        "rank_pattern": (bool(cfg.get("rank_pattern")), "per-module ranks are not supported"),
        "alpha_pattern": (bool(cfg.get("alpha_pattern")), "per-module alphas are not supported"),
        "fan_in_fan_out": (bool(cfg.get("fan_in_fan_out")), "fan_in_fan_out is not supported"),
    }
    for field, (bad, why) in refusals.items():
        if bad:
            raise ValueError(f"{path}: {field}={cfg.get(field)!r}: {why}")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{path}: r must be a positive int, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise ValueError(f"{path}: lora_alpha must be a positive number, got {alpha!r}")
    return cfg


def _check_base_copy(weights: Path, name: str, tensor: Tensor, model: Transformer) -> None:
    """A base weight saved along must be this model's own (we load adapters only)."""
    ours = model.tok_embeddings.weight if "embed_tokens" in name else model.output_weight
    if tuple(tensor.shape) != tuple(ours.shape) or not torch.equal(
            tensor.to(ours.dtype), ours.detach().cpu()):
        raise ValueError(f"{weights}: {name!r} differs from this model's weight; the adapter "
                         "was saved with other base weights (only LoRA weights are loaded)")


def read_adapter(directory: str | os.PathLike[str], model: Transformer
                 ) -> tuple[LoraSpec, dict[str, tuple[Tensor, Tensor]]]:
    """The spec and our key -> (A, B) tensors (float32) of a PEFT adapter for `model`."""
    root = Path(directory)
    cfg = _read_config(root)
    weights = root / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"{root}: no {WEIGHTS_NAME} (only safetensors adapters load)")
    r = int(cfg["r"])
    # 1) every tensor: a known module of an existing layer, with the right shape
    shapes, ours_of = _module_fans(model.config)
    found, expert_found = _checked_tensors(weights, cfg, model, r, shapes, ours_of)
    # 2) join the parts of each of our layers; a missing part is a zero adapter
    keys = {ours_key for ours_key, _ in found}
    spec = LoraSpec(rank=r, alpha=float(cfg.get("lora_alpha", 8)),
                    train_attn=any(".attn." in k for k in keys),
                    train_mlp=any(".mlp." in k for k in keys) or bool(expert_found),
                    train_unembed=HEAD in keys, rslora=bool(cfg.get("use_rslora", False)))
    joined: dict[str, tuple[Tensor, Tensor]] = {}
    E = model.config.num_experts
    for key, pair in expert_found.items():  # to ours: A (E, r, in), B (E, out, r)
        a, b = pair["A"], pair["B"]
        b = b.reshape(b.shape[0], r, E).permute(2, 0, 1)
        if key.endswith("gate_up") and _interleaved(model):
            b = deinterleave_gate_up(b)
        joined[key] = (a.reshape(E, r, a.shape[1]), b.contiguous())
    for key in sorted(keys):
        modules = (("lm_head",) if key == HEAD else
                   family_named(model.config.family).hf_modules(key.split(".", 2)[2]))
        a_parts, b_parts = [], []
        for part, module in enumerate(modules):
            fan_in, fan_out = shapes[module]
            got = found.get((key, part))
            a_parts.append(got["A"] if got else torch.zeros(r, fan_in))
            b_parts.append(got["B"] if got else torch.zeros(fan_out, r))
        joined[key] = (torch.cat(a_parts), torch.cat(b_parts))
    return spec, joined


def _module_fans(config: ModelConfig
                 ) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[str, int]]]:
    """(HF module -> (fan_in, fan_out), HF module -> (our layer, its part)) of the
    modules an adapter of a model of `config` may name."""
    shapes = {"lm_head": (config.dim, config.vocab_size)}
    ours_of: dict[str, tuple[str, int]] = {}
    for our_layer in LAYERS:
        for part, (module, (fan_out, fan_in)) in enumerate(module_shapes(config, our_layer)):
            shapes[module] = (fan_in, fan_out)
            ours_of[module] = (our_layer, part)
    return shapes, ours_of


def _checked_tensors(weights: Path, cfg: dict[str, Any], model: Transformer, r: int,
                     shapes: dict[str, tuple[int, int]], ours_of: dict[str, tuple[str, int]]
                     ) -> tuple[dict[tuple[str, int], dict[str, Tensor]],
                                dict[str, dict[str, Tensor]]]:
    """Step 1 of `read_adapter`: the file's LoRA tensors, float32, each checked: ((our
    layer key, part) -> {"A": ..., "B": ...}, "layers.i.mlp.gate_up"/"down" -> the
    same); base weights saved along are checked to be the model's and dropped."""
    config = model.config
    found: dict[tuple[str, int], dict[str, Tensor]] = {}
    expert_found: dict[str, dict[str, Tensor]] = {}
    for name, tensor in safetensors.torch.load_file(str(weights)).items():
        layer, head = _KEY.match(name), _HEAD_KEY.match(name)
        expert = _EXPERT_KEY.match(name)
        if expert is not None:
            key = _checked_expert_tensor(weights, cfg, config, r, name, tensor, expert)
            expert_found.setdefault(key, {})[expert[3]] = tensor.float()
            continue
        if name in _BASE_COPIES:
            _check_base_copy(weights, name, tensor, model)
            continue
        if layer is not None:
            i, module, which = int(layer[1]), layer[2], layer[3]
            if module not in ours_of or i >= config.n_layers:
                raise ValueError(f"{weights}: tensor {name!r} is not a layer this model has")
            ours, part = ours_of[module]
            where: tuple[str, int] = (f"layers.{i}.{ours}", part)
        elif head is not None:
            module, which, where = "lm_head", head[1], (HEAD, 0)
        else:
            raise ValueError(f"{weights}: tensor {name!r} is not a LoRA weight of a "
                             f"{config.family} attention, MLP or lm_head module")
        fan_in, fan_out = shapes[module]
        want = (r, fan_in) if which == "A" else (fan_out, r)
        if tuple(tensor.shape) != want:
            raise ValueError(f"{weights}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {want} (r={r})")
        found.setdefault(where, {})[which] = tensor.float()
    if not found and not expert_found:
        raise ValueError(f"{weights}: no LoRA tensors")
    for key, pair in expert_found.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{weights}: {key} has lora_{''.join(pair)} only")
    for (ours_key, part), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{weights}: {ours_key} part {part} has lora_{''.join(pair)} only")
    return found, expert_found


def _checked_expert_tensor(weights: Path, cfg: dict[str, Any], config: ModelConfig, r: int,
                           name: str, tensor: Tensor, expert: re.Match[str]) -> str:
    """An experts' adapter tensor (`_EXPERT_KEY`), checked; its key,
    "layers.i.mlp.gate_up" or "layers.i.mlp.down"."""
    i, which = int(expert[1]), ("gate_up" if expert[2] else "down")
    if sorted(cfg.get("target_parameters") or ()) != sorted(EXPERT_PARAMETERS):
        raise ValueError(f"{weights}: expert adapters load with target_parameters "
                         f"{list(EXPERT_PARAMETERS)}, got "
                         f"{cfg.get('target_parameters')!r}")
    if i >= config.n_layers or not config.is_moe(i):
        raise ValueError(f"{weights}: tensor {name!r} is not a mixture of experts "
                         "this model has")
    E, C, F = config.num_experts, config.dim, config.expert_hidden_dim
    fan_in, fan_out = (C, 2 * F) if which == "gate_up" else (F, C)
    want = (r * E, fan_in) if expert[3] == "A" else (fan_out, r * E)
    if tuple(tensor.shape) != want:
        raise ValueError(f"{weights}: tensor {name!r} has shape "
                         f"{tuple(tensor.shape)}, expected {want} (r={r})")
    return f"layers.{i}.mlp.{which}"


@torch.no_grad()
def load_into(model: Transformer, tensors: dict[str, tuple[Tensor, Tensor]]) -> None:
    """Set every adapter of a LoRA model (built with `read_adapter`'s spec) from `tensors`;
    adapters the file has no tensors for (a layer it skipped) become zero."""
    for key, adapter in lora_adapters(model).items():
        if isinstance(adapter, ExpertLora):
            for which, (a_param, b_param) in (
                    ("gate_up", (adapter.gate_up_A, adapter.gate_up_B)),
                    ("down", (adapter.down_A, adapter.down_B))):
                a, b = tensors.get(f"{key}.{which}", (None, None))
                if a is None or b is None:
                    a_param.zero_()
                    b_param.zero_()
                else:
                    a_param.copy_(a)
                    b_param.copy_(b)
            continue
        if key in tensors:
            a, b = tensors[key]
            adapter.lora_A.copy_(a)
            adapter.lora_B.copy_(b)
        else:
            adapter.lora_A.zero_()
            adapter.lora_B.zero_()
