"""What the fault suite's tests share: a tiny `prefixgym train` budget, what a finished
tiny run looks like, a fingerprint of every file under a directory ("no state
changed" is: the same fingerprint before and after), and a Llama checkpoint directory
written by hand."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from numerics import from_environment
from safetensors.torch import save_file

from prefixgym.prompting.build_tokenizer import ASSETS_DIR

# 10 metrics lines: eval, 2 sft, eval, 4 grpo, 2 evals; checkpoints warm_start,
# step-000001, step-000003. In the test dtype: runs in this process and runs started
# as processes are compared, and in a process `auto` would be this CPU's choice.
TINY = ["--steps", "4", "--checkpoint-every", "2", "--eval-every", "2", "--sft-steps", "2",
        "--sft-episodes-per-step", "2", "--groups-per-step", "1", "--group-size", "2",
        "--eval-episodes", "2", "--max-tokens", "4", "--no-progress",
        "--compute-dtype", from_environment().name]
TINY_LINES = 10


def fingerprint(root: Path) -> dict[str, str]:
    """Every file under `root` by relative path, with a hash of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_complete(out: Path) -> None:
    """A finished tiny run: every line once, in order, and its last checkpoint."""
    lines = metrics(out)
    assert [r["step"] for r in lines if r["phase"] == "grpo"] == [0, 1, 2, 3]
    assert [r["sft_step"] for r in lines if r["phase"] == "sft"] == [0, 1]
    assert [(r["when"], r["step"]) for r in lines if r["phase"] == "eval"] == [
        ("after warm start", 0), ("GRPO", 2), ("GRPO", 4)]
    assert (out / "checkpoints" / "latest").read_text() == "step-000003"
    assert (out / "report.md").exists()
    leftovers = [p.name for p in [*out.iterdir(), *(out / "checkpoints").iterdir()]
                 if p.name.endswith(".tmp")]
    assert leftovers == []


def hf_dir(directory: Path, config: dict[str, object] | None = None,
           poison: str | None = None) -> Path:
    """A Llama checkpoint directory (with the built-in tokenizer) written by hand;
    `poison` names a tensor to put a NaN in."""
    directory.mkdir()
    shutil.copy(ASSETS_DIR / "tokenizer.json", directory)
    shutil.copy(ASSETS_DIR / "tokenizer_config.json", directory)
    C, F, V = 32, 48, 4096
    shapes = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,),
              "model.layers.0.input_layernorm.weight": (C,),
              "model.layers.0.post_attention_layernorm.weight": (C,),
              "model.layers.0.self_attn.q_proj.weight": (C, C),
              "model.layers.0.self_attn.k_proj.weight": (16, C),
              "model.layers.0.self_attn.v_proj.weight": (16, C),
              "model.layers.0.self_attn.o_proj.weight": (C, C),
              "model.layers.0.mlp.gate_proj.weight": (F, C),
              "model.layers.0.mlp.up_proj.weight": (F, C),
              "model.layers.0.mlp.down_proj.weight": (C, F)}
    tensors = {name: torch.full(shape, 0.01) for name, shape in shapes.items()}
    if poison:
        tensors[poison][0] = float("nan")
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": C, "intermediate_size": F,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": V, "tie_word_embeddings": True, **(config or {})}))
    return directory
