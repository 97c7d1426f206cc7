"""Load a local Hugging Face checkpoint (config.json + *.safetensors) of a supported
family (`families.py`) into the built-in `Transformer`.

Steps: 1) read config.json into a `ModelConfig` (`hf_config.py`: the family, its knobs,
or one line naming what cannot be honoured), 2) index the tensors of every
*.safetensors file, 3) map the family's names onto ours (split q/k/v and gate/up, or a
family's fused ones, become our fused projections: one view of the file where the
parts lie back to back in our order, as gate/up do, else a copy), checking shapes,
then the whole model for NaN and inf in one fused pass (a tensor is named only when
one is found; the tensors of a file are views of its mapping, read as touched; no
other tensor is copied in the file's dtype), 4) materialise the
model from those tensors, keeping the parsed config.json on it (`hf_export.py` writes
it back), 5) hand the freed temporaries back to the system
(`malloc_tuning.release_free_memory`).

This module knows tensor names; it does not download anything or read tokenizers.
Every refusal is a ValueError naming the file: an unreadable *.safetensors file, a
tensor missing, of the wrong shape or of a non-floating-point dtype, or one holding
NaN or inf.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from prefixgym.engine import malloc_tuning
from prefixgym.engine.checkpoint_io import nonfinite_tensor
from prefixgym.engine.model.config import ModelConfig
from prefixgym.engine.model.decoder import Transformer
from prefixgym.engine.model.families import (
    EXPERT_MODULES,
    LAYERS,
    block_norms,
    family_named,
    module_shapes,
)
from prefixgym.engine.model.hf_config import config_from_hf, read_raw_config
from prefixgym.engine.model.hf_fallback import load_with_transformers

__all__ = ["deinterleave_gate_up", "dequantize_mxfp4", "interleave_gate_up",
           "load_hf_checkpoint"]


class _TensorIndex:
    """Which *.safetensors file holds each tensor name; loads on demand, through one open
    handle per file (opening a file maps it and parses its header again: ~1 ms a
    tensor). Tensors it hands out are views of the mapped files, read when touched.
    `close()` drops the handles; the tensors stay valid."""

    def __init__(self, directory: Path) -> None:
        self.files = sorted(directory.glob("*.safetensors"))
        if not self.files:
            raise FileNotFoundError(f"{directory}: no *.safetensors files found")
        self.where: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        self._got: list[str] = []  # the names `get` handed out, in order
        self._spans: dict[Path, dict[str, tuple[int, int]]] = {}  # `_byte_ranges`
        self._bytes: dict[Path, torch.Tensor] = {}  # each file's mapping, as uint8
        for file in self.files:
            try:
                handle = self._handles[file] = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as e:
                self.close()
                raise ValueError(f"{file} is not a readable safetensors file: {e}") from None
            for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                self.where.setdefault(key, file)

    def close(self) -> None:
        self._handles.clear()
        self._spans.clear()
        self._bytes.clear()

    def joined(self, keys: list[str], parts: list[torch.Tensor]) -> torch.Tensor:
        """`parts` (what `get` gave for `keys`) stacked along their rows: a view of the
        file's mapping where they lie back to back in it, in this order, as stored (no
        dtype conversion), else a copy. gate_proj and up_proj lie so in a file whose
        names are sorted; a view adds no memory and reads the file when touched (the
        copies of SmolLM2's gate/up were 212 MB of fresh memory at load, ~1 ms a MiB)."""
        if len(parts) == 1:
            return parts[0]
        view = self._view_of(keys, parts)
        return torch.cat(parts) if view is None else view.view(-1, *parts[0].shape[1:])

    def _view_of(self, keys: list[str], parts: list[torch.Tensor]) -> torch.Tensor | None:
        file = self.where[keys[0]]
        if any(self.where[key] != file for key in keys):
            return None
        if file not in self._spans:
            self._spans[file] = _byte_ranges(file)
        spans = self._spans[file]
        if any(key not in spans for key in keys) or any(
                p.data_ptr() != self._load(key)[0].data_ptr()
                for key, p in zip(keys, parts, strict=True)):
            return None  # (`get` converted one)
        begin, end = spans[keys[0]][0], spans[keys[-1]][1]
        if sum(p.nbytes for p in parts) != end - begin:
            return None  # not back to back, or not in this order
        if file not in self._bytes:
            storage = torch.UntypedStorage.from_file(str(file), shared=False,
                                                      nbytes=file.stat().st_size)
            self._bytes[file] = torch.asarray(storage, dtype=torch.uint8)
        try:
            return self._bytes[file][begin:end].view(parts[0].dtype)
        except RuntimeError:  # an offset that is not a multiple of the element size
            return None

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def quantized(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The MXFP4 tensor `key` (`key_blocks` and `key_scales`), dequantized to `shape`."""
        *lead, cols = shape
        if cols % 32:
            raise ValueError(f"{key}: MXFP4 needs a width divisible by 32, got {cols}")
        blocks = self._read(key + "_blocks", (*lead, cols // 32, 16), torch.uint8)
        scales = self._read(key + "_scales", (*lead, cols // 32), torch.uint8)
        converted = dequantize_mxfp4(blocks, scales).to(dtype)
        if nonfinite_tensor([(key, converted)]) is not None:
            raise ValueError(f"{self.where[key + '_blocks']}: tensor {key!r} overflows to inf "
                             f"in {dtype}")
        return converted

    def _load(self, key: str) -> tuple[torch.Tensor, Path]:
        """The stored tensor `key` as it is, and its file."""
        if key not in self.where:
            raise ValueError(f"checkpoint tensor {key!r} is missing (looked in {self.files})")
        file = self.where[key]
        try:
            return self._handles[file].get_tensor(key), file
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file}: cannot read tensor {key!r}: {e}") from None

    def _read(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The stored tensor `key`, which must have this shape and dtype."""
        tensor, file = self._load(key)
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"{file}: tensor {key!r} is {tensor.dtype} {tuple(tensor.shape)}, "
                             f"expected {dtype} {shape}")
        return tensor

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The stored tensor `key` of this shape, floating-point, in `dtype`. Its values
        are not looked at here: `check_finite` does that for the whole model at once."""
        tensor, file = self._load(key)
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{file}: tensor {key!r} has shape {tuple(tensor.shape)}, expected {shape}"
            )
        if not tensor.is_floating_point():
            raise ValueError(f"{file}: tensor {key!r} has dtype {tensor.dtype}; weights are "
                             "floating-point")
        self._got.append(key)
        return tensor.to(dtype)

    def check_finite(self, state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        """Refuse (ValueError naming the file and tensor) a model whose tensors hold NaN or
        inf, stored so or overflowing `dtype`. One fused norm over the built model decides
        (a fused copy holds NaN or inf exactly when one of its parts does); only when it
        finds one are the tensors read by `get` looked at one by one, for the name."""
        if nonfinite_tensor(state_dict.items()) is None:
            return
        for key in self._got:
            tensor, file = self._load(key)
            if nonfinite_tensor([(key, tensor)]) is not None:
                raise ValueError(f"{file}: tensor {key!r} holds NaN or inf values")
            if nonfinite_tensor([(key, tensor.to(dtype))]) is not None:
                raise ValueError(f"{file}: tensor {key!r} overflows to inf in {dtype}")
        bad = nonfinite_tensor(state_dict.items())
        raise ValueError(f"{self.files[0].parent}: the model's {bad!r} holds NaN or inf values")


def _byte_ranges(file: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's byte range in a safetensors `file` whose header safe_open has
    checked: 8 bytes of the header's length, then its JSON, each name's `data_offsets`
    counted from the header's end."""
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return {key: (8 + length + int(entry["data_offsets"][0]),
                  8 + length + int(entry["data_offsets"][1]))
            for key, entry in header.items() if key != "__metadata__"}


def _state_dict_from_hf(
    index: _TensorIndex, config: ModelConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The family's HF tensor names -> our layout (fused q/k/v and gate/up)."""
    prefix = "model." if "model.embed_tokens.weight" in index else ""
    C, V = config.dim, config.vocab_size

    def get(name: str, *shape: int) -> torch.Tensor:
        return index.get(prefix + name, tuple(shape), dtype)

    sd: dict[str, torch.Tensor] = {
        "tok_embeddings.weight": get("embed_tokens.weight", V, C),
        "norm.weight": get("norm.weight", C),
    }
    biased = {"attn.wqkv": config.qkv_bias, "attn.wo": config.out_bias}
    for i in range(config.n_layers):
        hf, ours = f"layers.{i}.", f"layers.{i}."
        for norm, hf_norm in block_norms(config):
            sd[ours + norm + ".weight"] = get(hf + hf_norm + ".weight", C)
        moe = config.is_moe(i)
        if moe:
            experts = _gpt_oss_experts if family_named(config.family).experts == "interleaved" \
                else _experts
            sd.update(experts(index, prefix + hf + "mlp.", ours + "mlp.", config, dtype))
        if config.attention_sinks:
            sd[ours + "attn.sinks"] = get(hf + "self_attn.sinks", config.n_heads)
        for layer in LAYERS:
            if moe and layer.startswith("mlp."):
                continue
            parts = module_shapes(config, layer)
            for kind in ("weight", "bias") if biased.get(layer) else ("weight",):
                keys = [f"{prefix}{hf}{module}.{kind}" for module, _ in parts]
                sd[f"{ours}{layer}.{kind}"] = index.joined(keys, [
                    index.get(key, shape if kind == "weight" else shape[:1], dtype)
                    for key, (_, shape) in zip(keys, parts, strict=True)])
        if config.qk_norm != "none":
            widths = ((config.n_heads, config.n_kv_heads) if config.qk_norm == "all_heads"
                      else (1, 1))
            for which, heads in zip(("q_norm", "k_norm"), widths, strict=True):
                sd[ours + f"attn.{which}.weight"] = get(hf + f"self_attn.{which}.weight",
                                                        heads * config.head_dim)
    if not config.tie_embeddings:
        sd["output.weight"] = index.get("lm_head.weight", (V, C), dtype)
    return sd


def _experts(index: _TensorIndex, hf: str, ours: str, config: ModelConfig, dtype: torch.dtype
             ) -> dict[str, torch.Tensor]:
    """One mixture's router and stacked experts, from either layout a checkpoint may
    hold: stacked (`experts.gate_up_proj`, `experts.down_proj`) or one module per
    expert (`experts.{e}.gate_proj.weight`, ...: what transformers saves and the Hub
    holds)."""
    E, C, F = config.num_experts, config.dim, config.expert_hidden_dim
    out = {ours + "router.weight": index.get(hf + "gate.weight", (E, C), dtype)}
    if hf + "experts.gate_up_proj" in index:
        out[ours + "w_gate_up"] = index.get(hf + "experts.gate_up_proj", (E, 2 * F, C), dtype)
        out[ours + "w_down"] = index.get(hf + "experts.down_proj", (E, C, F), dtype)
        return out
    gate, up, down = EXPERT_MODULES
    out[ours + "w_gate_up"] = torch.stack([torch.cat((
        index.get(f"{hf}experts.{e}.{gate}.weight", (F, C), dtype),
        index.get(f"{hf}experts.{e}.{up}.weight", (F, C), dtype))) for e in range(E)])
    out[ours + "w_down"] = torch.stack([index.get(f"{hf}experts.{e}.{down}.weight", (C, F), dtype)
                                        for e in range(E)])
    return out


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""MXFP4's 4-bit values (e2m1), by code: bit 3 the sign."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 to float32: `blocks` (..., G, 16) uint8, two 4-bit codes a byte (the low
    nibble first), and `scales` (..., G) uint8, a power of two each (biased by 127)
    for the 32 values of its group -> (..., G * 32). Exact: every value is a small
    binary fraction times a power of two."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # (..., G, 16, 2)
    values = lut[codes].flatten(-2)  # (..., G, 32)
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)


def deinterleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate/up interleaved along dim 1 (gate even, up odd) -> [gate | up]."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[gate | up] along dim 1 -> gpt-oss's interleaving (`deinterleave_gate_up` undone)."""
    gate, up = t.chunk(2, dim=1)
    return torch.stack((gate, up), dim=2).flatten(1, 2)


def _gpt_oss_experts(index: _TensorIndex, hf: str, ours: str, config: ModelConfig,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """gpt-oss's router (with its bias) and experts, dense or MXFP4: its gate and up
    columns interleaved (gate even, up odd) become our [gate | up] rows."""
    E, C, F = config.num_experts, config.dim, config.expert_hidden_dim
    out = {ours + "router.weight": index.get(hf + "router.weight", (E, C), dtype),
           ours + "router.bias": index.get(hf + "router.bias", (E,), dtype)}
    if hf + "experts.gate_up_proj_blocks" in index:
        gate_up = index.quantized(hf + "experts.gate_up_proj", (E, 2 * F, C), dtype)
        down = index.quantized(hf + "experts.down_proj", (E, C, F), dtype)
    else:  # stored transposed: x @ W
        gate_up = index.get(hf + "experts.gate_up_proj", (E, C, 2 * F), dtype).transpose(1, 2)
        down = index.get(hf + "experts.down_proj", (E, F, C), dtype).transpose(1, 2)
    bias = index.get(hf + "experts.gate_up_proj_bias", (E, 2 * F), dtype)
    out[ours + "w_gate_up"] = deinterleave_gate_up(gate_up)
    out[ours + "b_gate_up"] = deinterleave_gate_up(bias)
    out[ours + "w_down"] = down.contiguous()
    out[ours + "b_down"] = index.get(hf + "experts.down_proj_bias", (E, C), dtype)
    return out


def load_hf_checkpoint(
    directory: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    max_seq_len: int | None = None,
) -> Transformer:
    """Build a `Transformer` from a local HF checkpoint directory (train mode)."""
    root = Path(directory)
    # 1) config.json, as our config
    raw = read_raw_config(root)
    config = config_from_hf(raw, root / "config.json", max_seq_len)
    if config.family == "transformers":  # no code here: transformers' own, our KV behind
        return load_with_transformers(root, config, raw, dtype)
    # 2) + 3) tensors, renamed and fused, then checked for NaN and inf all at once
    index = _TensorIndex(root)
    try:
        state_dict = _state_dict_from_hf(index, config, dtype)
        index.check_finite(state_dict, dtype)
    finally:
        index.close()
    # 4) no random init for weights that are about to be replaced
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    model.build_rope_tables(torch.device("cpu"))  # in the weights' dtype, as HF casts cos/sin
    model.hf_config = raw
    del state_dict
    # 5) the checks' and fusions' freed temporaries leave malloc's arenas (glibc only)
    malloc_tuning.release_free_memory()
    return model
