"""Shared helpers of the engine benchmarks: threads, machine facts, spreads, HF peers.

Import this module before torch does any work: it sets `OMP_WAIT_POLICY=PASSIVE` (so
idle OpenMP workers do not spin on a shared machine) when the caller has not chosen.
`hf_llama_from(model)` builds a transformers `LlamaForCausalLM` with the same config
and a copy of the same weights, so every comparison runs on identical numbers.

This module knows nothing of workloads; each benchmark builds its own.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from prefixgym.engine.model import Transformer

T = TypeVar("T")


def setup_threads(threads: int = 2) -> None:
    torch.set_num_threads(threads)


@contextmanager
def num_threads(threads: int) -> Iterator[None]:
    """Run the block on `threads` torch threads, then restore the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def machine_facts() -> str:
    """One line: cores, CPU model, torch version and threads, load average."""
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"nproc={os.cpu_count()} cpu='{model}' torch={torch.__version__} "
        f"threads={torch.get_num_threads()} OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} "
        f"loadavg=[{load}]"
    )


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def spread(values: Sequence[float], fmt: str = "{:.3g}") -> str:
    """'median (min-max, n=N)' of repeated measurements."""
    med = statistics.median(values)
    return f"{fmt.format(med)} ({fmt.format(min(values))}-{fmt.format(max(values))}, n={len(values)})"


def hf_llama_from(model: Transformer) -> Any:
    """A transformers LlamaForCausalLM (sdpa attention, eval mode) with `model`'s weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = model.config
    hf_config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.hidden_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=cfg.qkv_bias,
        attn_implementation="sdpa",
    )
    dtype = next(model.parameters()).dtype
    hf = LlamaForCausalLM(hf_config).to(dtype)
    H, Hkv, D, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_dim
    src = {k: v.detach() for k, v in model.state_dict().items()}
    dst: dict[str, torch.Tensor] = {"model.embed_tokens.weight": src["tok_embeddings.weight"],
                                    "model.norm.weight": src["norm.weight"]}
    if not cfg.tie_embeddings:
        dst["lm_head.weight"] = src["output.weight"]
    for i in range(cfg.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        wqkv = src[p + "attn.wqkv.weight"]
        dst[q + "self_attn.q_proj.weight"] = wqkv[: H * D]
        dst[q + "self_attn.k_proj.weight"] = wqkv[H * D : (H + Hkv) * D]
        dst[q + "self_attn.v_proj.weight"] = wqkv[(H + Hkv) * D :]
        if cfg.qkv_bias:
            bias = src[p + "attn.wqkv.bias"]
            dst[q + "self_attn.q_proj.bias"] = bias[: H * D]
            dst[q + "self_attn.k_proj.bias"] = bias[H * D : (H + Hkv) * D]
            dst[q + "self_attn.v_proj.bias"] = bias[(H + Hkv) * D :]
        dst[q + "self_attn.o_proj.weight"] = src[p + "attn.wo.weight"]
        gate_up = src[p + "mlp.w_gate_up.weight"]
        dst[q + "mlp.gate_proj.weight"] = gate_up[:F]
        dst[q + "mlp.up_proj.weight"] = gate_up[F:]
        dst[q + "mlp.down_proj.weight"] = src[p + "mlp.w_down.weight"]
        dst[q + "input_layernorm.weight"] = src[p + "attn_norm.weight"]
        dst[q + "post_attention_layernorm.weight"] = src[p + "mlp_norm.weight"]
    missing, unexpected = hf.load_state_dict(dst, strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"weight copy mismatch: missing {missing}, unexpected {unexpected}")
    hf.requires_grad_(False)
    return hf.eval()


def check_same_logits(model: Transformer, hf: Any, length: int = 24) -> float:
    """Max |logit difference| of ours vs HF on one random sequence (sanity check)."""
    tokens = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours = model(tokens)
        theirs = hf(input_ids=tokens).logits.float()
    return float((ours - theirs).abs().max())
