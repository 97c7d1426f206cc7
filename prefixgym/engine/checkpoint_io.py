"""Atomic save and load of a training state directory.

A checkpoint directory holds:
  weights-<id>.safetensors  the model's parameters (tied tensors handled by safetensors)
  state-<id>.pt             everything else: optimizer state, step, RNG states
  manifest.json             which two files make up the checkpoint, written last

Every file is written atomically (`prefixgym.files`); data files get a fresh id each save, so until the new manifest
lands the old manifest still names intact old files. A crash mid-save leaves the
previous checkpoint loadable. Stale files are removed after the manifest is replaced.

This module knows nothing of losses or optimizers: it stores a model and a dict of
tensors/plain values that `torch.load(weights_only=True)` can read back.
"""

from __future__ import annotations

import json
import os
import random
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from prefixgym.files import write_file_atomically, write_text_atomically

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def save_checkpoint(
    path: str | os.PathLike[str], model: torch.nn.Module,
    state: dict[str, Any],  # a torch.save payload: tensors, optimizer state, plain values
) -> None:
    """Write `model`'s parameters and `state` into directory `path` (created if needed)."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    ckpt_id = uuid.uuid4().hex[:12]
    weights_name, state_name = f"weights-{ckpt_id}.safetensors", f"state-{ckpt_id}.pt"
    write_file_atomically(directory / weights_name,
                          lambda tmp: safetensors.torch.save_model(model, tmp))
    write_file_atomically(directory / state_name, lambda tmp: torch.save(state, tmp))
    manifest = {"format": FORMAT_VERSION, "weights": weights_name, "state": state_name}
    write_text_atomically(directory / MANIFEST, json.dumps(manifest))
    for stale in directory.iterdir():
        if stale.name.startswith(("weights-", "state-")) and stale.name not in manifest.values():
            stale.unlink(missing_ok=True)


def load_checkpoint(path: str | os.PathLike[str], model: torch.nn.Module) -> dict[str, Any]:
    """Load parameters into `model` (same architecture required) and return the saved state."""
    directory = Path(path)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"no checkpoint at {directory}: {MANIFEST} is missing")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {directory} has format {manifest.get('format')!r}, "
            f"expected {FORMAT_VERSION}"
        )
    device = next(model.parameters()).device
    missing, unexpected = safetensors.torch.load_model(
        model, str(directory / manifest["weights"]), strict=False, device=str(device)
    )
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {directory} does not match the model: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
    state: dict[str, Any] = torch.load(directory / manifest["state"], weights_only=True)
    return state


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
