"""Sampling copies' linear layers on oneDNN's packed weights (CPU).

torch's `F.linear` runs fp32 on the CPU through its wheel's BLAS (MKL), which on the few
rows of a decode step, and on AMD CPUs at all, leaves much of the machine unused. oneDNN
with each weight reordered once into the blocked layout its kernels read (for 32 rows,
as vLLM's CPU backend and torch's inductor do) took 0.53 ms instead of 0.86 for 32 rows
768 -> 2,304, and 9.1 instead of 23 ms for a 32,000-token head (fp32, AMD EPYC, 2
threads; bf16, which torch already runs in oneDNN, gains 1.2x from the layout alone).
Only what samples is packed: training keeps `F.linear` (oneDNN's packed op has no
gradient), so sampler and trainer logprobs differ by float noise, as across batch sizes.

1) `PackedLinear`: y = x W^T + b on W packed by `torch.ops.mkldnn._reorder_linear_weight`.
   A *private* one (a full publish's snapshot, which no one else holds; its head too)
   packs at once and keeps no dense weight: no memory added (but for the head, whose
   dense matrix stays the model's `output` or embedding). A *shared* one (version 0,
   a LoRA model's frozen base: the trainer's own tensors) keeps the dense weight, packs at its first
   forward and again whenever the weight changed in place (its version counter), so it
   never serves stale weights; it is made once per weight and reused by every model
   that shares that weight (one packed copy: the memory of the linear weights once more).
2) `WeightPacker.pack(model, shared)` swaps them in for an inference model's attention
   and MLP linears (a LoRA layer's base) and, as `Transformer.head_linear`, its output
   head, where `packs` says it applies (a CPU model of our own families in fp32 or bf16
   on a torch with oneDNN) and the weight has `MIN_ELEMENTS` or more. A private model's
   block reorders run on the caller's thread, one after another: on 2 threads (a pool)
   they allocated in the pool threads' malloc arenas, and in a GRPO run each publish
   then touched 210-265 MiB of fresh pages instead of ~110 (0.6 s instead of 0.4). Its
   head, which glibc maps afresh whatever the thread (it is above malloc's 32 MiB mmap
   threshold), packs on the packer's one helper thread meanwhile, followed by the
   caller's `beside` (a publish's checks of the weights), each on one OpenMP thread:
   in GRPO on SmolLM2-135M (AMD EPYC, 2 cores), a full publish took 0.24-0.38 s with
   its 121 reorders, its NaN check and its probe forward one after another, 0.13-0.23 s
   side by side (the same bits: nothing reads what the other thread writes).
3) An fp32 shape whose oneDNN product rounds differently by thread count stays on
   `F.linear` (`onednn_linear.py`, where the check and its kept answers live).

Knows the model's modules; nothing of the sampler.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from prefixgym.engine.model.decoder import Transformer
from prefixgym.engine.model.layers import MixtureOfExperts
from prefixgym.engine.model.onednn_linear import (
    packed_product,
    packed_weight,
    stored_invariant,
    thread_counts,
)

__all__ = ["PackedLinear", "WeightPacker", "packed_layers", "packs", "thread_counts"]

MIN_ELEMENTS = 512 * 512
"""Smaller weights stay on `F.linear`: oneDNN's ~15 us a call outweighs what it gains
there (one row of 256 -> 256: 6 us by `F.linear`, 17 packed; 512 -> 512 breaks even at
one row and gains from 8)."""
LAYERS = ("wqkv", "wo", "w_gate_up", "w_down")
"""The attribute names of the linears packed in each block (a mixture's router and
experts are not: the router's top-k turns on last bits, the experts are 3-D)."""

_mkldnn = torch.ops.mkldnn


def packs(model: Transformer) -> bool:
    """Whether `WeightPacker` would pack `model`: one of our own families (not run
    through transformers' code) on the CPU in fp32 or bf16, with torch's oneDNN."""
    if model.config.family == "transformers" or not torch.backends.mkldnn.is_available():
        return False
    weight = model.tok_embeddings.weight
    return (weight.device.type == "cpu" and hasattr(_mkldnn, "_reorder_linear_weight")
            and (weight.dtype == torch.float32 or (
                weight.dtype == torch.bfloat16 and _mkldnn._is_mkldnn_bf16_supported())))


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward on a packed weight, for inference (see the module doc)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, shared: bool) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias_tensor = None if bias is None else bias.detach()
        self.source: torch.Tensor | None = weight.detach() if shared else None
        """The dense weight a shared layer follows (None: private, packed for good)."""
        self._packed: torch.Tensor | None = None if shared else packed_weight(weight)
        self._seen = -1  # the source's version counter when last packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("a packed linear layer samples only: oneDNN's packed op "
                               "has no gradient (train the trainer's model)")
        if self.source is not None and self._seen != self.source._version:
            self._packed, self._seen = packed_weight(self.source), self.source._version
        assert self._packed is not None
        return packed_product(x, self._packed, self.bias_tensor)

    def extra_repr(self) -> str:
        kind = "shared" if self.source is not None else "private"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


class WeightPacker:
    """Packs a service's inference models (`pack`); shared layers are made once per
    weight and reused while a model holds them.

    `counts`: the thread counts an fp32 shape must give the same bits on to be packed
    (default `thread_counts()`). `enabled` False packs nothing
    (`SamplerOptions.pack_weights`)."""

    def __init__(self, enabled: bool = True, counts: Sequence[int] | None = None) -> None:
        self.enabled = enabled
        self.counts = thread_counts() if counts is None else tuple(counts)
        self._shared: weakref.WeakValueDictionary[tuple[object, ...], PackedLinear] = (
            weakref.WeakValueDictionary())
        self._lock = threading.Lock()
        # each shape's answer once read (or checked): a full publish asks for 121 layers
        # of SmolLM2-135M, and the store's key and path took ~20 ms a publish to build
        self._verdicts: dict[tuple[int, int, torch.dtype, bool], bool] = {}
        self._helper: ThreadPoolExecutor | None = None  # made at the first private pack

    def pack(self, model: Transformer, shared: bool,
             beside: Callable[[], None] | None = None) -> Transformer:
        """`model` (an inference copy, changed in place) with its block linears and its
        head packed, where they apply; `shared`: its weights are also another model's.
        `beside()` runs too (for a private model on the helper thread, while the blocks
        pack), and what it raises is raised here, with `model` left as it was: a
        publish's checks, which then cost no time of their own."""
        packing = self.enabled and packs(model)
        if beside is not None and (shared or not packing):
            beside()  # (nothing to run it beside: a shared model packs at its first forward)
        if not packing:
            return model
        private: list[tuple[nn.Module, str, nn.Linear]] = []  # packed below, at once
        for parent, name, layer in _block_linears(model):
            base = layer._modules.get("base")  # a LoRA layer's
            if isinstance(layer, nn.Linear) and not shared:
                private.append((parent, name, layer))
            elif isinstance(layer, nn.Linear):
                setattr(parent, name, self._shared_layer(layer) or layer)
            elif isinstance(base, nn.Linear):
                setattr(layer, "base", self._shared_layer(base) or base)
        # a private model's tied head packs at once too: its publish carries it, not the
        # version's first sample (the embedding stays, for the lookup)
        head = model.output if model.output is not None else model.tok_embeddings
        if shared:
            model.head_linear = self._shared_layer(head)
        else:
            head_packed = self._alongside(head, beside)
            made = self._private_layers([p[2] for p in private])
            model.head_linear = head_packed.result()
            for (parent, name, layer), packed in zip(private, made, strict=True):
                setattr(parent, name, packed or layer)
        # every matmul of its decode step runs wide (`packed_product`, attention), so the rest
        # may run on one thread: not where a linear stayed on `F.linear`, nor a mixture
        model.narrow_steps = model.head_linear is not None and not any(
            isinstance(m, nn.Linear | MixtureOfExperts) for m in model.layers.modules())
        return model

    def close(self) -> None:
        """Stop the helper thread (a later private pack starts another)."""
        with self._lock:
            helper, self._helper = self._helper, None
        if helper is not None:
            helper.shutdown()

    def private_weights(self, model: Transformer) -> list[torch.Tensor]:
        """The block linears' weights that `pack(model, shared=False)` would pack: each
        gets a packed copy of its own and the dense one is dropped, so a snapshot about
        to be packed need not copy them first (`EngineService.publish_weights`)."""
        if not (self.enabled and packs(model)):
            return []
        return [layer.weight for _, _, layer in _block_linears(model)
                if isinstance(layer, nn.Linear) and self._packable(layer)]

    def _packable(self, layer: nn.Linear | nn.Embedding) -> bool:
        """Whether `layer` is packed: not small, and not an fp32 shape that rounds by
        thread count."""
        weight = layer.weight
        bias = layer.bias if isinstance(layer, nn.Linear) else None
        if weight.numel() < MIN_ELEMENTS:
            return False
        if weight.dtype != torch.float32 or len(self.counts) == 1:
            return True
        key = (*weight.shape, weight.dtype, bias is not None)
        if key not in self._verdicts:
            self._verdicts[key] = stored_invariant(weight, bias, self.counts)
        return self._verdicts[key]

    def _shared_layer(self, layer: nn.Linear | nn.Embedding) -> PackedLinear | None:
        """`layer`'s shared packed layer (None where `_packable` says no)."""
        if not self._packable(layer):
            return None
        weight = layer.weight
        bias = layer.bias if isinstance(layer, nn.Linear) else None
        key = (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype,
               None if bias is None else bias.data_ptr())
        with self._lock:
            packed = self._shared.get(key)
            if packed is None:
                packed = self._shared[key] = PackedLinear(weight, bias, shared=True)
            return packed

    def _alongside(self, head: nn.Linear | nn.Embedding,
                   beside: Callable[[], None] | None) -> Future[PackedLinear | None]:
        """`head` packed for good, then `beside()`, on the helper thread, which computes
        on one OpenMP thread and hands back the caller's count: torch's thread count
        also sets MKL's, which is one for the whole process."""
        self._packable(head)  # answered here (a thread check, if one): the helper reads it
        count = torch.get_num_threads()

        def work() -> PackedLinear | None:
            torch.set_num_threads(1)
            try:
                packed = self._private_layers([head])[0]
                if beside is not None:
                    beside()
                return packed
            finally:
                torch.set_num_threads(count)

        with self._lock:
            if self._helper is None:
                self._helper = ThreadPoolExecutor(1, thread_name_prefix="prefixgym-pack")
            return self._helper.submit(work)

    def _private_layers(self, layers: list[nn.Linear | nn.Embedding]) -> list[PackedLinear | None]:
        """Each of `layers` packed for good (None where `_packable` says no)."""
        return [PackedLinear(layer.weight, layer.bias if isinstance(layer, nn.Linear) else None,
                             shared=False) if self._packable(layer) else None
                for layer in layers]


def _block_linears(model: Transformer) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, child) for each child named in `LAYERS` of each block's
    modules, read from the module dicts (a missing name through `getattr` costs
    `nn.Module.__getattr__`'s error, ~1,000 times a publish on SmolLM2-135M)."""
    return [(parent, name, child) for block in model.layers for parent in block.modules()
            for name in LAYERS if (child := parent._modules.get(name)) is not None]


def packed_layers(model: nn.Module) -> list[PackedLinear]:
    """The `PackedLinear`s of `model` (for tests and stats)."""
    return [m for m in model.modules() if isinstance(m, PackedLinear)]
