"""Atomic, verified save and load of a training state directory.

A checkpoint directory holds:
  weights-<id>.safetensors  the model's parameters (tied tensors handled by safetensors)
  state-<id>.pt             everything else: optimizer state, step, RNG states
  manifest.json             which two files make up the checkpoint and their
                            checksums, written last

Every file is written atomically (`prefixgym.files`); data files get a fresh id each
save, so until the new manifest lands the old manifest still names intact old files.
A crash mid-save leaves the previous checkpoint loadable. Stale files, and the
temporaries of a killed save, are removed after the manifest is replaced.

Nothing damaged or non-finite passes either way: `save_checkpoint` refuses weights or
optimizer state holding NaN/inf, and `load_checkpoint` checks, before it changes the
model at all, the checksums, the tensor names, shapes and dtypes, and that every
floating-point value is finite -- each error a ValueError naming the file or tensor.

This module knows nothing of losses or optimizers: it stores a model and a dict of
tensors/plain values that `torch.load(weights_only=True)` can read back.
"""

from __future__ import annotations

import json
import os
import random
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.torch
import torch
from torch.nn.utils import get_total_norm

from prefixgym.files import (
    file_checksum,
    is_temporary,
    verify_checksums,
    write_file_atomically,
    write_text_atomically,
)

MANIFEST = "manifest.json"
FORMAT_VERSION = 2
"""2: the manifest records each file's checksum (1 had none and is refused)."""


def nonfinite_tensor(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an inf, if any.

    One fused norm over all of them decides (on CPU about 10x faster than `isfinite`
    per tensor, which cost ~60 ms a check on `tiny`); only a norm that is not finite,
    which huge finite values can also give, is followed by the check per tensor."""
    named = [(name, t) for name, t in tensors if t.is_floating_point()]
    with torch.no_grad():
        if not named or bool(torch.isfinite(get_total_norm([t for _, t in named]))):
            return None
        for name, tensor in named:
            if not bool(torch.isfinite(tensor).all()):
                return name
    return None


def named_state_tensors(value: object, prefix: str = "state") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside a nested dict/list payload, named by its path."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from named_state_tensors(item, f"{prefix}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from named_state_tensors(item, f"{prefix}[{i}]")


def save_checkpoint(
    path: str | os.PathLike[str], model: torch.nn.Module,
    state: dict[str, Any],  # a torch.save payload: tensors, optimizer state, plain values
) -> None:
    """Write `model`'s parameters and `state` into directory `path` (created if needed).
    Refuses (ValueError, nothing written) weights or state that are not finite."""
    bad = nonfinite_tensor(model.named_parameters()) or nonfinite_tensor(
        named_state_tensors(state))
    if bad is not None:
        raise ValueError(f"not saving a checkpoint to {path}: {bad} holds NaN or inf values")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    ckpt_id = uuid.uuid4().hex[:12]
    weights_name, state_name = f"weights-{ckpt_id}.safetensors", f"state-{ckpt_id}.pt"
    write_file_atomically(directory / weights_name,
                          lambda tmp: safetensors.torch.save_model(model, tmp))
    write_file_atomically(directory / state_name, lambda tmp: torch.save(state, tmp))
    manifest = {"format": FORMAT_VERSION, "weights": weights_name, "state": state_name,
                "checksums": {name: file_checksum(directory / name)
                              for name in (weights_name, state_name)}}
    write_text_atomically(directory / MANIFEST, json.dumps(manifest))
    for stale in directory.iterdir():
        if (stale.name.startswith(("weights-", "state-")) and stale.name not in manifest.values()
                or is_temporary(stale.name)):
            stale.unlink(missing_ok=True)


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's manifest, checked: format, file names, and each file's checksum.
    FileNotFoundError when there is no manifest; ValueError naming the file otherwise."""
    directory = Path(path)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"no checkpoint at {directory}: {MANIFEST} is missing")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{manifest_path} is not a readable JSON manifest: {e}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{manifest_path} does not hold a JSON object")
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"{manifest_path} has format {manifest.get('format')!r}, expected {FORMAT_VERSION} "
            "(a checkpoint written by another prefixgym version)"
        )
    checksums = manifest.get("checksums")
    names = [manifest.get("weights"), manifest.get("state")]
    if (not isinstance(checksums, dict) or not all(isinstance(n, str) for n in names)
            or sorted(checksums) != sorted(names)):  # type: ignore[type-var]
        raise ValueError(f"{manifest_path} must name a weights and a state file with their "
                         "checksums")
    verify_checksums(directory, checksums, manifest_path)
    return manifest


def load_checkpoint(path: str | os.PathLike[str], model: torch.nn.Module) -> dict[str, Any]:
    """Load parameters into `model` (same architecture required) and return the saved state.

    Everything is read and checked before the model changes: a damaged, foreign or
    non-finite checkpoint raises ValueError and leaves `model` as it was.
    """
    directory = Path(path)
    manifest = read_manifest(directory)
    weights_path, state_path = directory / manifest["weights"], directory / manifest["state"]
    try:
        tensors = safetensors.torch.load_file(str(weights_path))
    except (safetensors.SafetensorError, OSError) as e:
        raise ValueError(f"{weights_path} is not a readable safetensors file: {e}") from None
    check_weights(tensors, model, str(weights_path))
    try:
        state: dict[str, Any] = torch.load(state_path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, EOFError, UnpicklingError...
        first_line = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"{state_path} is not a readable training state: "
                         f"{type(e).__name__}: {first_line}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{state_path} does not hold a training state dict")
    bad = nonfinite_tensor(named_state_tensors(state))
    if bad is not None:
        raise ValueError(f"{state_path}: {bad} holds NaN or inf values")
    with torch.no_grad():
        params = model.state_dict()
        for name, tensor in tensors.items():
            params[name].copy_(tensor)
    return state


def check_weights(tensors: Mapping[str, torch.Tensor], model: torch.nn.Module, where: str) -> None:
    """`tensors` can replace `model`'s parameters: the same names (a tied alias may be
    absent), shapes, floating-point dtypes, and only finite values. ValueError naming
    `where` and the tensor otherwise."""
    expected = model.state_dict()
    pointers = {name: t.data_ptr() for name, t in expected.items()}
    stored = {pointers[name] for name in tensors if name in pointers}
    missing = sorted(name for name in expected
                     if name not in tensors and pointers[name] not in stored)
    unexpected = sorted(name for name in tensors if name not in expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint {where} does not match the model: missing {missing}, "
                         f"unexpected {unexpected}")
    for name, tensor in tensors.items():
        want = expected[name]
        if tuple(tensor.shape) != tuple(want.shape):
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, the "
                             f"model's is {tuple(want.shape)}")
        if not tensor.is_floating_point():
            raise ValueError(f"{where}: tensor {name!r} has dtype {tensor.dtype}; weights are "
                             "floating-point")
    bad = nonfinite_tensor(tensors.items())
    if bad is not None:
        raise ValueError(f"{where}: tensor {bad!r} holds NaN or inf values")


def capture_rng_state() -> dict[str, Any]:
    """torch (CPU and CUDA), python `random` and numpy global RNG states, loadable safely."""
    np_state: Any = np.random.get_state()  # a 5-tuple, though numpy's stub says a dict
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np_state
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "kind": np_kind,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    n = rng["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
