"""Checkpoints that are damaged, foreign or non-finite never load and never change the
model: flipped bytes, truncation, an empty manifest, NaN or integer tensors. Non-finite
weights are never saved; a killed save's temporaries are removed by the next one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from prefixgym.engine.checkpoint_io import MANIFEST, load_checkpoint, save_checkpoint
from prefixgym.engine.model import ModelConfig, Transformer, init_weights
from prefixgym.files import file_checksum

CONFIG = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                     hidden_dim=64, max_seq_len=32)


def model(seed: int = 0) -> Transformer:
    m = Transformer(CONFIG)
    init_weights(m, seed)
    return m


def snapshot(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def unchanged(m: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    save_checkpoint(tmp_path / "ckpt", model(1), {"step": 3, "moments": torch.ones(4)})
    return tmp_path / "ckpt"


def data_file(ckpt: Path, kind: str) -> Path:
    return ckpt / json.loads((ckpt / MANIFEST).read_text())[kind]


def test_a_saved_checkpoint_loads(ckpt: Path) -> None:
    target = model(0)
    state = load_checkpoint(ckpt, target)
    assert state["step"] == 3
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), model(1).parameters()))


@pytest.mark.parametrize("kind", ["weights", "state"])
def test_a_flipped_byte_is_an_error_naming_the_file(ckpt: Path, kind: str) -> None:
    path = data_file(ckpt, kind)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, one bit
    path.write_bytes(bytes(data))
    target = model(0)
    before = snapshot(target)
    with pytest.raises(ValueError, match=f"{path.name} is damaged"):
        load_checkpoint(ckpt, target)
    assert unchanged(target, before)


@pytest.mark.parametrize("kind", ["weights", "state"])
def test_a_truncated_file_is_an_error_naming_the_file(ckpt: Path, kind: str) -> None:
    path = data_file(ckpt, kind)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    target = model(0)
    before = snapshot(target)
    with pytest.raises(ValueError, match=path.name):
        load_checkpoint(ckpt, target)
    assert unchanged(target, before)


@pytest.mark.parametrize("text", ["", "{", "[]", '{"format": 1, "weights": "w", "state": "s"}'])
def test_a_bad_manifest_is_an_error_naming_it(ckpt: Path, text: str) -> None:
    (ckpt / MANIFEST).write_text(text)
    with pytest.raises(ValueError, match="manifest.json"):
        load_checkpoint(ckpt, model(0))


def rewrite_weights(ckpt: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Replace the weights file and re-sign it, as a tool that writes valid but bad
    weights would: the checksum passes, the content checks must not."""
    path = data_file(ckpt, "weights")
    safetensors.torch.save_file(tensors, str(path))
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["checksums"][path.name] = file_checksum(path)
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def test_nan_weights_are_an_error_naming_the_tensor(ckpt: Path) -> None:
    tensors = {k: v.clone() for k, v in model(1).state_dict().items()}
    tensors["layers.0.attn.wo.weight"][3, 5] = float("nan")
    rewrite_weights(ckpt, tensors)
    target = model(0)
    before = snapshot(target)
    with pytest.raises(ValueError, match=r"'layers\.0\.attn\.wo\.weight' holds NaN"):
        load_checkpoint(ckpt, target)
    assert unchanged(target, before)


def test_integer_weights_are_an_error_naming_the_tensor(ckpt: Path) -> None:
    tensors = {k: v.clone() for k, v in model(1).state_dict().items()}
    tensors["norm.weight"] = tensors["norm.weight"].to(torch.int32)
    rewrite_weights(ckpt, tensors)
    with pytest.raises(ValueError, match=r"'norm\.weight' has dtype torch\.int32"):
        load_checkpoint(ckpt, model(0))


def test_nan_optimizer_state_is_an_error(tmp_path: Path) -> None:
    m = model(0)
    with pytest.raises(ValueError, match=r"state\.moments holds NaN"):
        save_checkpoint(tmp_path / "c", m, {"moments": torch.tensor([1.0, float("inf")])})
    assert not (tmp_path / "c").exists()


def test_nan_weights_are_never_saved(tmp_path: Path, ckpt: Path) -> None:
    m = model(0)
    with torch.no_grad():
        m.norm.weight[0] = float("nan")
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    with pytest.raises(ValueError, match="norm.weight holds NaN"):
        save_checkpoint(ckpt, m, {"step": 4})
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before


def test_a_killed_saves_temporaries_are_removed_by_the_next_save(ckpt: Path) -> None:
    (ckpt / ".weights-abc.safetensors.x1y2.tmp").write_bytes(b"partial")
    (ckpt / ".state-abc.pt.x1y2.tmp").write_bytes(b"partial")
    save_checkpoint(ckpt, model(2), {"step": 5})
    assert sorted(p.name.split("-")[0] for p in ckpt.iterdir()) == [
        "manifest.json", "state", "weights"]
