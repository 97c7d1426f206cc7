"""LoRA adapters inside the decoder's linear layers, and frozen snapshots that share weights.

A `LoraAdapter` is the low-rank update of one linear layer: y += scale * B(A x).
Our q/k/v and gate/up projections are fused, so one adapter covers several
Hugging Face modules ("parts"): each part has its own rank-r slice of A and its own
rows of B, exactly as PEFT keeps one adapter per q_proj/k_proj/v_proj -- so an adapter
converts 1:1 to and from PEFT's format (`peft_format.py`). A `LoraLinear` wraps the
model's `nn.Linear` and adds its adapter's output; it is swapped in for the linear,
so every caller of the layer (training, the trie forward, the sampler's prefill and
decode) runs the adapter without knowing it.

1) `add_lora` builds a LoRA model from a base `Transformer`: a structural copy whose
   base tensors are the base model's storage, frozen (no copy of the weights), with
   `LoraLinear`s swapped in for the targeted layers. A is drawn from a seeded
   generator (PEFT's default: uniform +-1/sqrt(in)), B is zero, so the LoRA model
   starts equal to the base. Adapters are float32 (master weights) whatever the base
   dtype; they run in the input's dtype.
2) `frozen_copy` snapshots a model for sampling: tensors that do not require grad
   (a LoRA model's base weights, buffers) are shared, the others (the adapters, or
   every weight of a fully trained model) are copied, large ones into a freed
   snapshot's tensors where `SpareCopies` kept one. `frozen_view` shares them all
   (the service's version 0, until a full training client unshares it).

This module knows the model's module names and the `LoraSpec`; not optimizers,
files, or PEFT's names (that is `peft_format.py`).
"""

from __future__ import annotations

import collections
import math
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from prefixgym.engine.model.decoder import Transformer
from prefixgym.engine.model.families import module_shapes
from prefixgym.engine.model.layers import Block, MixtureOfExperts

__all__ = [
    "ExpertLora", "LoraAdapter", "LoraLinear", "LoraSpec", "SpareCopies", "add_lora",
    "adapter_module", "frozen_copy", "frozen_view", "lora_adapters",
]

Tensor = torch.Tensor
HEAD = "head"
"""The adapters' key of the output head (the unembedding)."""


@dataclass(frozen=True)
class LoraSpec:
    """Which layers get an adapter, of what rank, and its scale (alpha / rank, as PEFT
    without rsLoRA; alpha / sqrt(rank) with `rslora`)."""

    rank: int = 32
    alpha: float = 32.0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = False
    rslora: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive int, got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha)
                and self.alpha > 0):
            raise ValueError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise ValueError("LoRA needs at least one of train_attn, train_mlp, train_unembed")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


class LoraAdapter(nn.Module):
    """delta(x) = scale * B(A x) for one linear layer of `parts` output widths.

    lora_A: (P*r, in) -- part p's A is rows [p*r, (p+1)*r); lora_B: (sum(parts), r) --
    part p's B is its own rows. Part p's output rows see only part p's slice of A x.
    """

    def __init__(self, in_features: int, parts: tuple[int, ...], rank: int, scale: float,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.parts = parts
        self.rank = rank
        self.scale = scale
        self.lora_A = nn.Parameter(torch.zeros(len(parts) * rank, in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(sum(parts), rank, device=device))

    @torch.no_grad()
    def reset(self, generator: torch.Generator) -> None:
        """PEFT's default init: A uniform in +-1/sqrt(in_features), B zero."""
        bound = 1.0 / math.sqrt(self.lora_A.shape[1])
        drawn = torch.rand(self.lora_A.shape, generator=generator) * (2 * bound) - bound
        self.lora_A.copy_(drawn)
        self.lora_B.zero_()

    def forward(self, x: Tensor) -> Tensor:
        r = self.rank
        xa = F.linear(x, self.lora_A.to(x.dtype)) * self.scale  # (..., P*r)
        B = self.lora_B.to(x.dtype)
        if len(self.parts) == 1:
            return F.linear(xa, B)
        outs, row = [], 0
        for p, width in enumerate(self.parts):
            outs.append(F.linear(xa[..., p * r : (p + 1) * r], B[row : row + width]))
            row += width
        return torch.cat(outs, dim=-1)


class ExpertLora(nn.Module):
    """Low-rank updates of a mixture's experts, one per expert, as PEFT adapts stacked
    expert parameters (`target_parameters`): expert e's gate/up weight gains
    scale * B_e A_e, and so does its down weight. Stored per expert in our row order:
    `gate_up_A` (E, r, C), `gate_up_B` (E, 2F, r), `down_A` (E, r, F), `down_B` (E, C, r)
    (`peft_format.py` converts to PEFT's (r * E, in) / (out, r * E) layout)."""

    def __init__(self, num_experts: int, dim: int, hidden: int, rank: int, scale: float,
                 device: torch.device | None = None) -> None:
        super().__init__()
        E = num_experts
        self.rank, self.scale = rank, scale
        self.gate_up_A = nn.Parameter(torch.zeros(E, rank, dim, device=device))
        self.gate_up_B = nn.Parameter(torch.zeros(E, 2 * hidden, rank, device=device))
        self.down_A = nn.Parameter(torch.zeros(E, rank, hidden, device=device))
        self.down_B = nn.Parameter(torch.zeros(E, dim, rank, device=device))

    @torch.no_grad()
    def reset(self, generator: torch.Generator) -> None:
        """PEFT's init: A uniform in +-1/sqrt(in_features) (gate/up first), B zero."""
        for a, b in ((self.gate_up_A, self.gate_up_B), (self.down_A, self.down_B)):
            bound = 1.0 / math.sqrt(a.shape[2])
            a.copy_(torch.rand(a.shape, generator=generator) * (2 * bound) - bound)
            b.zero_()

    def delta(self, x: Tensor, expert: int, which: str) -> Tensor:
        """scale * B_e(A_e x) for `which` ("gate_up" or "down") of one expert's rows."""
        a, b = (self.gate_up_A, self.gate_up_B) if which == "gate_up" else (
            self.down_A, self.down_B)
        return F.linear(F.linear(x, a[expert].to(x.dtype)) * self.scale, b[expert].to(x.dtype))


class LoraLinear(nn.Module):
    """A frozen `nn.Linear` plus its adapter: base(x) + adapter(x)."""

    def __init__(self, base: nn.Linear, adapter: LoraAdapter) -> None:
        super().__init__()
        self.base = base
        self.adapter = adapter

    @property
    def weight(self) -> Tensor:
        """The base layer's weight (what code reading `linear.weight` expects)."""
        return self.base.weight

    @property
    def bias(self) -> Tensor | None:
        return self.base.bias

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.adapter(x)


def _targets(model: Transformer, spec: LoraSpec) -> dict[str, tuple[nn.Module, str, tuple[int, ...]]]:
    """Our adapter key -> (parent module, attribute, output parts), in model order. The
    parts are the family's HF modules (`families.module_shapes`): q, k and v for most,
    one fused qkv for Phi-3, so that an adapter is PEFT's, module for module."""
    cfg = model.config

    def parts(layer: str) -> tuple[int, ...]:
        return tuple(shape[0] for _, shape in module_shapes(cfg, layer))

    found: dict[str, tuple[nn.Module, str, tuple[int, ...]]] = {}
    for i, layer in enumerate(model.layers):
        block = cast(Block, layer)
        if spec.train_attn:
            found[f"layers.{i}.attn.wqkv"] = (block.attn, "wqkv", parts("attn.wqkv"))
            found[f"layers.{i}.attn.wo"] = (block.attn, "wo", parts("attn.wo"))
        if spec.train_mlp and isinstance(block.mlp, MixtureOfExperts):
            found[f"layers.{i}.mlp"] = (block.mlp, "adapter", ())  # an `ExpertLora`
        elif spec.train_mlp:
            found[f"layers.{i}.mlp.w_gate_up"] = (block.mlp, "w_gate_up", parts("mlp.w_gate_up"))
            found[f"layers.{i}.mlp.w_down"] = (block.mlp, "w_down", parts("mlp.w_down"))
    return found


def add_lora(base: Transformer, spec: LoraSpec, seed: int = 0) -> Transformer:
    """A LoRA model on `base`'s weights (shared, frozen); steps in the module docstring."""
    if base.config.family == "transformers":
        kind = (base.hf_config or {}).get("model_type")
        raise ValueError(f"LoRA is not supported yet for {kind}, which runs through "
                         "transformers' own code (docs/models.md); full fine-tuning is "
                         "(create_training_client; --lora-rank 0)")
    # 1) structure copied, tensors shared: new frozen Parameters on the same storage
    model = _share_all(base)
    # 2) adapters swapped in, drawn in model order from one seeded generator
    generator = torch.Generator().manual_seed(seed)
    device = base.tok_embeddings.weight.device
    cfg = model.config
    for _key, (parent, attr, parts) in _targets(model, spec).items():
        if isinstance(parent, MixtureOfExperts):
            experts = ExpertLora(cfg.num_experts, cfg.dim, cfg.expert_hidden_dim, spec.rank,
                                 spec.scale, device)
            experts.reset(generator)
            parent.adapter = experts
            continue
        linear = getattr(parent, attr)
        adapter = LoraAdapter(linear.in_features, parts, spec.rank, spec.scale, device)
        adapter.reset(generator)
        setattr(parent, attr, LoraLinear(linear, adapter))
    if spec.train_unembed:
        head = LoraAdapter(cfg.dim, (cfg.vocab_size,), spec.rank, spec.scale, device)
        head.reset(generator)
        model.head_adapter = head
    return model


def lora_adapters(model: Transformer) -> dict[str, LoraAdapter | ExpertLora]:
    """Our key ("layers.3.attn.wqkv", ..., "layers.3.mlp" for a mixture's experts,
    "head") -> adapter, in model order."""
    found: dict[str, LoraAdapter | ExpertLora] = {
        name.removesuffix(".adapter"): m for name, m in model.named_modules()
        if isinstance(m, (LoraAdapter, ExpertLora)) and name.endswith(".adapter")}
    if isinstance(model.head_adapter, LoraAdapter):
        found[HEAD] = model.head_adapter
    return found


def adapter_module(model: Transformer) -> nn.Module:
    """The adapters alone, as one module (what a LoRA checkpoint saves and loads)."""
    holder = nn.Module()
    for key, adapter in lora_adapters(model).items():
        holder.add_module(key.replace(".", "_"), adapter)
    return holder


M = TypeVar("M", bound=nn.Module)


def _copy_structure(module: M, param: Callable[[nn.Parameter], nn.Parameter],
                    memo: dict[int, object] | None = None) -> M:
    """A copy of the module tree (new module objects, own child/parameter dicts) whose
    parameters are `param(p)` (called once per distinct parameter: ties stay tied) and
    whose buffers are shared. Much faster than `copy.deepcopy` (no pickling protocol)."""
    memo = {} if memo is None else memo
    if id(module) in memo:
        return cast(M, memo[id(module)])
    new = module.__class__.__new__(module.__class__)
    memo[id(module)] = new
    new.__dict__ = {k: (v.copy() if isinstance(v, dict) else v)
                    for k, v in module.__dict__.items()}
    for name, p in module._parameters.items():
        if p is not None:
            if id(p) not in memo:
                memo[id(p)] = param(p)
            new._parameters[name] = cast(nn.Parameter, memo[id(p)])
    for name, child in module._modules.items():
        if child is not None:
            new._modules[name] = _copy_structure(child, param, memo)
    return new


def _share_all(model: Transformer) -> Transformer:
    """A structural copy whose parameters are new frozen Parameters on the same storage."""
    return _copy_structure(model, lambda p: nn.Parameter(p.detach(), requires_grad=False))


def frozen_view(model: Transformer) -> Transformer:
    """A frozen, eval-mode model on `model`'s storage: it sees in-place changes to it."""
    return _share_all(model).eval()


def frozen_copy(model: Transformer, share: Iterable[torch.Tensor] = (),
                spares: SpareCopies | None = None) -> Transformer:
    """A frozen, eval-mode copy for sampling: tensors that do not require grad are
    shared, the others copied (a LoRA model's publish copies its adapters only), but
    for those in `share`, which the copy holds on `model`'s storage as new frozen
    Parameters: a full publish packs those at once, so a copy made first is waste.
    `spares`: where large copies go (into a freed snapshot's tensors)."""
    shared = {id(p) for p in share}
    copies: list[Tensor] = []

    def param(p: nn.Parameter) -> nn.Parameter:
        if id(p) in shared:
            return nn.Parameter(p.detach(), requires_grad=False)
        if not p.requires_grad:
            return p
        copies.append(p.detach().clone() if spares is None else spares.copy(p.detach()))
        return nn.Parameter(copies[-1], requires_grad=False)

    snapshot = _copy_structure(model, param).eval()
    if spares is not None:
        spares.keep(snapshot, copies)
    return snapshot


SPARE_MIN_BYTES = 32 << 20
"""Copies of at least this size are reused (`SpareCopies`): glibc maps every allocation
above 32 MiB (its largest mmap threshold) afresh and unmaps it when freed, so each full
publish of SmolLM2-135M touched a new 113 MB embedding copy (~1 ms a MiB on a VM);
smaller ones come back from malloc's arenas."""


class SpareCopies:
    """Large copies of `frozen_copy`, written into a freed snapshot's tensor of the same
    shape where one is kept: when a snapshot is freed (no client holds its version any
    more; views of its tensors, as a packed layer's bias, go with it), its copies
    become spares; one snapshot's worth is kept.

    No lock: spares come back when a snapshot is freed, maybe inside `copy` on the same
    thread; list and dict operations are atomic, and a race keeps one spare too many,
    which is harmless."""

    def __init__(self) -> None:
        self._spares: dict[tuple[object, ...], list[Tensor]] = {}
        self._most: dict[tuple[object, ...], int] = {}

    @staticmethod
    def _key(tensor: Tensor) -> tuple[object, ...]:
        return tuple(tensor.shape), tensor.dtype, tensor.device

    def copy(self, tensor: Tensor) -> Tensor:
        spares = self._spares.get(self._key(tensor)) if tensor.nbytes >= SPARE_MIN_BYTES \
            else None
        return spares.pop().copy_(tensor) if spares else tensor.clone()

    def keep(self, snapshot: nn.Module, copies: list[Tensor]) -> None:
        """The large ones of `copies` (`snapshot`'s) become spares once it is freed."""
        large = [t for t in copies if t.nbytes >= SPARE_MIN_BYTES]
        for key, count in collections.Counter(map(self._key, large)).items():
            self._most[key] = max(self._most.get(key, 0), count)
        if large:
            weakref.finalize(snapshot, self._give_back, large).atexit = False

    def _give_back(self, tensors: list[Tensor]) -> None:
        for tensor in tensors:
            spares = self._spares.setdefault(self._key(tensor), [])
            if len(spares) < self._most.get(self._key(tensor), 0):
                spares.append(tensor)
