"""Families with no code here: transformers' own modeling code, our KV views behind it.

A checkpoint whose `model_type` no family here covers (families.py) but transformers
does loads as a `TransformersCodeModel`: transformers builds the model from the
directory with an attention function of ours registered in its `AttentionInterface`,
as vLLM's Transformers backend does. Each layer's attention hands its new keys and
values to the forward's `KVView` (the sampler's `PagedView` / `DecodeView`, the
trainer's `TrieKV`, or a plain causal one) and attends to what the view returns, under
its mask; so the KV pool, the prefix cache and shared-prefix training run unchanged.
`bench_families.py --fallback` timed transformers' Llama this way at 0.98x our prefill
and 1.12x our decode; the families with code here stay the fast path.

1) transformers builds the model (`from_pretrained` on the local directory: no hub).
2) One forward of a few tokens records what each layer's attention is handed: every
   layer must call ours and pass the view on, keys and values must share one head count
   and width, and the `sliding_window` a layer passes becomes its window. Soft-capped
   attention or sinks are refused (those families have code here).
3) The logits must equal those of transformers' own SDPA attention on the same tokens,
   within float noise, through our split of the forward into `hidden` (the base
   model) and `head` (its output embedding, and the logit scale or cap the config
   names): a head that does more is refused with the difference.

Full fine-tuning, sampling, `compute_logprobs`, checkpoints and export
(`save_pretrained`) work; LoRA is refused (`lora.add_lora`). `recompute` is ignored, and
dropout is off (transformers' modules stay in eval mode).

Knows transformers' model API and our `KVView`; not the sampler, trainer or families.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prefixgym.engine.model.config import ModelConfig
from prefixgym.engine.model.decoder import Transformer
from prefixgym.engine.model.layers import KVView, causal_window_mask

__all__ = ["ATTENTION", "TransformersCodeModel", "load_with_transformers"]

ATTENTION = "prefixgym_kv_view"
"""The name our attention function is registered under in transformers."""
_PROBE_TOKENS = 48
_forward = threading.local()  # .view: the KV view of this thread's forward in progress


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None,
               dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: (B, H, T, D) queries, (B, Hkv, T, D)
    new keys/values; returns (B, T, H, D) and no weights."""
    view = getattr(_forward, "view", None)  # (not a keyword: some families drop those)
    if view is None:
        raise RuntimeError(f"{type(module).__name__} attends outside a prefixgym forward")
    if isinstance(view, _Probe):
        view.record(module, key, value, kwargs)
    k_all, v_all, mask = view.update(module.layer_idx, key, value)  # type: ignore[arg-type]
    q = query if k_all.dtype == query.dtype else query.to(k_all.dtype)  # fp32 keys: attend in fp32
    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask,
                                         is_causal=mask is None and q.shape[2] > 1,
                                         enable_gqa=q.shape[1] != k_all.shape[1], scale=scaling)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


class _Causal:
    """The view of a forward without a KV store: its own keys, causal, windowed per layer."""

    def __init__(self, windows: tuple[int, ...], T: int) -> None:
        self.windows, self.T = windows, T

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        window = self.windows[layer_idx] if layer_idx < len(self.windows) else 0
        if window and self.T > window:
            return k, v, causal_window_mask(self.T, window, k.device)
        return k, v, None


class _Probe(_Causal):
    """A causal view that records, per layer, what its attention was handed."""

    def __init__(self, T: int) -> None:
        super().__init__((), T)
        self.seen: dict[int, tuple[int, int, int, int]] = {}  # layer -> (Hkv, Dk, Dv, window)
        self.refused: list[str] = []

    def record(self, module: nn.Module, key: torch.Tensor, value: torch.Tensor,
               kwargs: dict[str, Any]) -> None:
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            self.refused.append(f"{type(module).__name__} has no layer_idx")
            return
        for name, what in (("softcap", "soft-capped attention"), ("s_aux", "attention sinks")):
            if kwargs.get(name) is not None:
                self.refused.append(what)
        window = kwargs.get("sliding_window") or 0
        self.seen[layer] = (key.shape[1], key.shape[-1], value.shape[-1], int(window))


class TransformersCodeModel(Transformer):
    """A `Transformer` whose layers are transformers' modules (`hf`): the same calls
    (`forward`, `hidden`, `head`, `clone_for_inference`, ...), so the engine and the
    trainer take it as any other. Its state dict is `hf`'s, under "hf."."""

    def __init__(self, hf: Any, config: ModelConfig, raw: dict[str, Any]) -> None:
        nn.Module.__init__(self)  # (not Transformer's: transformers built the layers)
        self.config = config
        self.hf = hf
        self.head_adapter = None
        self.hf_config = raw
        self.narrow_steps = False  # (transformers' linears are not packed)

    @property
    def layers(self) -> nn.ModuleList:  # type: ignore[override]
        """None of ours (what LoRA and the router loss look for)."""
        return nn.ModuleList()

    @property
    def tok_embeddings(self) -> nn.Embedding:  # type: ignore[override]
        return self.hf.get_input_embeddings()  # type: ignore[no-any-return]

    @property
    def output_weight(self) -> torch.Tensor:
        return self.hf.get_output_embeddings().weight  # type: ignore[no-any-return]

    def build_rope_tables(self, device: torch.device | str | None = None) -> None:
        """Nothing: transformers' modules keep their own rotary tables."""

    def train(self, mode: bool = True) -> TransformersCodeModel:
        """Sets `training`, but transformers' modules stay in eval mode: no dropout
        (checkpoints that name one would otherwise train on other numbers than the
        sampler computes, as RL must not)."""
        super().train(mode)
        self.hf.eval()
        return self

    def hidden(self, tokens_B_T: torch.Tensor, positions_B_T: torch.Tensor | None = None,
               kv: KVView | None = None, last_only: bool = False,
               last_index_B: torch.Tensor | None = None, recompute: bool = False,
               check_inputs: bool = True) -> torch.Tensor:
        positions = self.checked_positions(tokens_B_T, positions_B_T, check_inputs)
        B, T = tokens_B_T.shape
        view = kv if kv is not None else _Causal(self.config.windows, T)
        decoder = getattr(self.hf, self.hf.base_model_prefix)
        _forward.view = view
        try:
            h = decoder(input_ids=tokens_B_T, position_ids=positions.expand(B, T),
                        use_cache=False).last_hidden_state  # (B, T, C), after the final norm
        finally:
            _forward.view = None
        if last_only:
            if last_index_B is None:
                return h[:, -1:]  # type: ignore[no-any-return]
            return h[torch.arange(B, device=h.device), last_index_B].unsqueeze(1)  # type: ignore[no-any-return]
        return h  # type: ignore[no-any-return]

    def head(self, h_N_C: torch.Tensor) -> torch.Tensor:
        """The output embedding, then what transformers' causal-LM classes do to logits
        by their config: `logit_scale` (Cohere) multiplies, `logits_scaling` (Granite's
        MoE) divides, `final_logit_softcapping` caps."""
        logits = self.hf.get_output_embeddings()(h_N_C)
        text = self.hf.config.get_text_config()
        if getattr(text, "logit_scale", None) is not None:
            logits = logits * text.logit_scale
        if getattr(text, "logits_scaling", None):
            logits = logits / text.logits_scaling
        cap = getattr(text, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        """The checkpoint as transformers writes it (what `hf_export` does for ours)."""
        self.hf.save_pretrained(directory, safe_serialization=True)


def load_with_transformers(directory: str | os.PathLike[str], config: ModelConfig,
                           raw: dict[str, Any], dtype: torch.dtype) -> TransformersCodeModel:
    """The checkpoint as a `TransformersCodeModel` (train mode): steps 1-3 of the
    module docstring; ValueError naming the directory and the reason it cannot run."""
    where, kind = Path(directory) / "config.json", raw.get("model_type")
    model = TransformersCodeModel(_built(directory, dtype, where, kind), config, raw)  # 1)
    T = min(_PROBE_TOKENS, config.max_seq_len)
    ids = torch.arange(T).remainder(config.vocab_size - 3).add(3).unsqueeze(0)
    model.config = _probed_config(model, config, ids, where, kind)  # 2)
    _check_logits(model, ids, dtype, where, kind)  # 3)
    warnings.warn(f"{kind} has no code in prefixgym: it runs through transformers' modeling "
                  "code over prefixgym's KV cache (sampling and full training; no LoRA yet)",
                  stacklevel=2)
    return model.train()


def _built(directory: str | os.PathLike[str], dtype: torch.dtype, where: Path,
           kind: object) -> Any:
    """Step 1: transformers' model of `kind` (its model_type), every weight from the
    checkpoint; errors name `where` (its config.json)."""
    import transformers
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)
    try:
        with _quiet(transformers):
            loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(
                directory, dtype=dtype, attn_implementation=ATTENTION, local_files_only=True,
                output_loading_info=True)
        hf, info = loaded
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{where}: transformers cannot build this {kind} model: {first}") from None
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(what):  # transformers would start those weights at random, or drop them
            names = sorted(str(k) for k in info[what])
            raise ValueError(f"{where}: the checkpoint does not fit transformers' {kind} model: "
                             f"{len(names)} {what.replace('_', ' ')} ({', '.join(names[:3])}"
                             f"{', ...' if len(names) > 3 else ''})")
    return hf


def _probed_config(model: TransformersCodeModel, config: ModelConfig, ids: torch.Tensor,
                   where: Path, kind: object) -> ModelConfig:
    """Step 2: `config` with the KV heads, widths and windows each layer's attention is
    handed, once every layer is seen handing one kind of key/value."""
    probe = _Probe(ids.shape[1])
    with torch.no_grad():
        try:
            model.hidden(ids, kv=probe)
        except RuntimeError as err:
            raise ValueError(f"{where}: {kind} cannot run with prefixgym's KV store: {err}") from None
    shapes = {(hkv, dk, dv) for hkv, dk, dv, _ in probe.seen.values()}
    if probe.refused or sorted(probe.seen) != list(range(config.n_layers)) or len(shapes) != 1:
        why = (", ".join(sorted(set(probe.refused))) if probe.refused
               else f"its attention layers {sorted(probe.seen)} of {config.n_layers}"
               if len(shapes) == 1 else f"keys and values shaped {sorted(shapes)}")
        raise ValueError(f"{where}: {kind} cannot run with prefixgym's KV store ({why}); "
                         "only decoders with one kind of key/value per layer can")
    ((hkv, dk, dv),) = shapes
    if dk != dv or config.n_heads % hkv:
        raise ValueError(f"{where}: {kind} has keys of width {dk} and values of width {dv} "
                         f"in {hkv} heads; prefixgym's KV store needs equal widths")
    windows = tuple(probe.seen[i][3] for i in range(config.n_layers))
    return dataclasses.replace(config, n_kv_heads=hkv, head_dim_override=dk,
                               layer_windows=windows if any(windows) else None)


def _check_logits(model: TransformersCodeModel, ids: torch.Tensor, dtype: torch.dtype,
                  where: Path, kind: object) -> None:
    """Step 3: our logits are those of transformers' own attention."""
    hf = model.hf
    with torch.no_grad():
        ours = model.head(model.hidden(ids))
        hf.set_attn_implementation("sdpa")
        try:
            reference = hf(input_ids=ids, use_cache=False).logits.float()
        finally:
            hf.set_attn_implementation(ATTENTION)
    scale = float(reference.abs().max()) or 1.0
    diff = float((ours - reference).abs().max())
    if not diff <= (1e-4 if dtype == torch.float32 else 3e-2) * max(scale, 1.0):
        raise ValueError(f"{where}: {kind}'s logits here differ from transformers' own by "
                         f"{diff:.2g} (of {scale:.2g}): its forward does more than its "
                         "decoder and output embedding, which prefixgym cannot run yet")


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """No progress bar from transformers' loader (ours reads tensors silently too)."""
    shown = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            transformers.utils.logging.enable_progress_bar()
