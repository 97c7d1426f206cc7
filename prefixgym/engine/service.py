"""EngineService: the built-in sampling and training service, in token ids.

It owns the trainable model, one frozen inference copy per published weights version,
the KV pool and the prefix cache over its blocks, the engine thread and the usage
ledger, all on one torch device, and hands out clients: `create_sampling_client()` (latest version, or a saved LoRA adapter with
`model_path=`), `create_training_client()` (every weight),
`create_lora_training_client()` (LoRA adapters on the frozen model, `lora.py`),
`publish_weights()` (snapshot the trainable model as a new version). A LoRA version
shares the base weights and copies only its adapters. Cache keys include the version,
so KV computed under old weights never serves new ones; an old version stays usable
for as long as a client holds it.

The service knows token ids only: no tokenizer, no chat format. Its caller gives it
the end-of-turn ids to stop at and, for stop strings, a `decode(ids) -> str`
(`prefixgym.LocalService` does both from its tokenizer). It knows nothing of
environments, conversations or losses.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any, Self, TypeVar

import torch

from prefixgym.engine import malloc_tuning
from prefixgym.engine.checkpoint_io import nonfinite_tensor
from prefixgym.engine.device import resolve_device
from prefixgym.engine.model import ModelConfig, Transformer, init_weights, load_model, peft_format
from prefixgym.engine.model.lora import (
    LoraSpec,
    SpareCopies,
    adapter_module,
    add_lora,
    frozen_copy,
    frozen_view,
    lora_adapters,
)
from prefixgym.engine.model.packed import WeightPacker
from prefixgym.engine.sampler.engine import Engine
from prefixgym.engine.sampler.options import SamplerOptions
from prefixgym.engine.sampler.sampling import SamplingClient
from prefixgym.engine.trainer.options import TrainerOptions
from prefixgym.engine.trainer.training import TrainingClient
from prefixgym.engine.usage import UsageLedger
from prefixgym.types import Usage

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineService:
    """The local engine. `model`: a preset name, a local HF checkpoint directory, a
    `ModelConfig` (randomly initialised with `seed`) or a `Transformer` (used as is).

    `sampler`: the sampler wing's `SamplerOptions` (the prefix cache and its KV pool,
    request limits, thread tuning, determinism), or its fields as keywords
    (`EngineService("tiny", prefix_cache=False)`), not both.
    `dtype`: the weights' dtype. `device`: where the models, the KV pool and every engine
    and training tensor live ("cpu", "cuda", "cuda:1", "mps", ... as torch knows them;
    "auto", the default: a GPU when torch sees one, else the CPU: `device.resolve_device`).
    `num_threads` sets torch's intra-op threads (process-wide) only when given.
    `end_of_turn_ids`: token ids every sampling client stops at by default (ids outside
    the model's vocabulary are dropped). `decode`: ids -> text, needed only for requests
    with stop strings.
    """

    def __init__(
        self,
        model: str | ModelConfig | Transformer = "tiny",
        seed: int = 0,
        *,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "auto",
        num_threads: int | None = None,
        end_of_turn_ids: Iterable[int] = (),
        decode: Callable[[list[int]], str] | None = None,
        sampler: SamplerOptions | None = None,
        **sampler_fields: Any,
    ) -> None:
        options = _options(SamplerOptions, sampler, sampler_fields)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        torch_dtype = _DTYPES.get(dtype) if isinstance(dtype, str) else dtype
        if torch_dtype is None or torch_dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        try:
            self.device = resolve_device(device)
            torch.empty(0, device=self.device)
        except (RuntimeError, AssertionError) as error:  # torch's words, in one line
            raise ValueError(f"device {str(device)!r} is not usable here: {error}") from error
        self.train_model = _build_model(model, torch_dtype, seed).to(self.device)
        self.model_name = model if isinstance(model, str) else ""
        self._seed = seed
        cfg = self.train_model.config
        self.ledger = UsageLedger()
        self.engine = Engine(cfg, options, self.device, torch_dtype, decode=decode,
                             ledger=self.ledger, seed=seed)
        self._packer = WeightPacker(options.pack_weights)
        self._spares = SpareCopies()  # a full publish's embedding copy, reused
        self._default_stop_ids = tuple(
            dict.fromkeys(int(i) for i in end_of_turn_ids if 0 <= int(i) < cfg.vocab_size))
        self._lock = threading.Lock()
        self._version = 0  # the latest published version
        self._last_version_id = 0  # every version's id is new, published or loaded
        # Version 0 shares the loaded weights until a full training client is created
        # (LoRA leaves them untouched): the loaded weights are held once, not twice.
        self._inference_model = self._packer.pack(frozen_view(self.train_model), shared=True)
        self._weights_shared = True
        self._training_clients: list[TrainingClient[SamplingClient]] = []

    @property
    def weights_version(self) -> int:
        return self._version

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The ids every sampling client stops at by default (`end_of_turn_ids` given)."""
        return self._default_stop_ids

    @property
    def max_seq_len(self) -> int:
        """The longest sequence (prompt + sampled tokens) the model takes."""
        return int(self.train_model.config.max_seq_len)

    def create_sampling_client(
        self, stop_at_end_of_turn: bool = True, *,
        model_path: str | os.PathLike[str] | None = None,
    ) -> SamplingClient:
        """A client for the latest published weights, or, with `model_path`, for the
        model with the PEFT LoRA adapter in that directory (as `save_weights_for_sampler`
        writes, or PEFT's `save_pretrained`), as a new version. With
        `stop_at_end_of_turn`, the end-of-turn ids given at construction are added to
        every request's stop ids."""
        stop_ids = self._default_stop_ids if stop_at_end_of_turn else ()
        if model_path is not None:
            spec, tensors = peft_format.read_adapter(model_path, self.train_model)
            lora = add_lora(self.train_model, spec)
            peft_format.load_into(lora, tensors)
            lora.requires_grad_(False).eval()
            self._packer.pack(lora, shared=True)
            with self._lock:
                self._last_version_id += 1
                version = self._last_version_id
            return SamplingClient(self.engine, lora, version, default_stop_token_ids=stop_ids)
        with self._lock:
            model, version = self._inference_model, self._version
        return SamplingClient(self.engine, model, version, default_stop_token_ids=stop_ids)

    def publish_weights(self, check: Callable[[], None] | None = None) -> SamplingClient:
        """Snapshot `train_model` as a new frozen weights version; a client for it.
        Refuses (ValueError) weights holding NaN or inf, and whatever `check()` (a
        trainer's probe) raises, run while the snapshot packs. The linears that get
        packed are not copied first: packing one is its copy; the rest is copied by
        `frozen_copy`'s structure copy, not `copy.deepcopy` (on SmolLM2-135M the deep
        copy took 0.5-0.7 s of a 1.2 s publish)."""
        packed = self._packer.private_weights(self.train_model)
        snapshot = (frozen_copy(self.train_model, share=packed, spares=self._spares) if packed
                    else self.train_model.clone_for_inference())
        return self._publish(snapshot, private=True, check=check)

    @torch.no_grad()
    def _unshare_weights(self) -> None:
        """Give `train_model` storage of its own before anything trains it in place, so
        version 0 and LoRA models made until now keep the weights as loaded."""
        if self._weights_shared:
            for param in self.train_model.parameters():
                param.data = param.data.clone()
            self._weights_shared = False

    def _publish(
        self, snapshot: Transformer,
        changed: Iterable[tuple[str, torch.Tensor]] | None = None, private: bool = False,
        check: Callable[[], None] | None = None,
    ) -> SamplingClient:
        """Make `snapshot` the latest version, unless `check()` raises or a tensor of
        `changed` (default: all its parameters) holds NaN or inf; both run beside the
        packing (`WeightPacker.pack`). A LoRA snapshot passes its adapters only: the
        frozen base it shares cannot have changed, and scanning 2 GB of it took seconds
        per publish on a 0.5B model. `private`: no other model holds its weights (its
        linears are packed in place)."""
        # listed now: the packing swaps the snapshot's modules while the checks run
        tensors = list(snapshot.named_parameters() if changed is None else changed)

        def checks() -> None:
            if check is not None:
                check()
            bad = nonfinite_tensor(tensors)
            if bad is not None:
                raise ValueError(f"not publishing weights: {bad} holds NaN or inf values")

        self._packer.pack(snapshot, shared=not private, beside=checks)
        if private:
            _own_storage(snapshot, self.train_model)
        with self._lock:
            self._last_version_id += 1
            self._version = self._last_version_id
            self._inference_model = snapshot
        # Release what earlier versions and steps left: a version that no client holds is
        # freed with the last reference to it (no cycle holds one: a finished request
        # drops its samples, which pointed back at it; a test holds this), but freed
        # tensors stay resident in malloc's arenas; without the trim, full GRPO on
        # SmolLM2-135M grew its peak ~0.5 GB a step (docs/benchmarks.md, "Memory per GRPO
        # step"). It runs on a thread of its own (0.02-0.4 s there): the client need not
        # wait for it. (A full collection here, ~170 ms a publish, freed nothing more.)
        malloc_tuning.release_free_memory_later()
        return self.create_sampling_client()

    def _publish_adapters(self, snapshot: Transformer,
                          check: Callable[[], None] | None = None) -> SamplingClient:
        return self._publish(snapshot, (
            (f"{key}.{name}", tensor) for key, adapter in lora_adapters(snapshot).items()
            for name, tensor in adapter.named_parameters()), check=check)

    def create_training_client(
        self, options: TrainerOptions | None = None, **option_fields: Any,
    ) -> TrainingClient[SamplingClient]:
        """A trainer of every weight of `train_model`, computing as `options` says (the
        trainer wing's `TrainerOptions`: the compute dtype, prefix sharing, what backward
        keeps, the non-finite policy), or its fields as keywords
        (`create_training_client(share_prefixes=False)`), not both."""
        self._unshare_weights()
        client: TrainingClient[SamplingClient] = TrainingClient(
            self.train_model, _options(TrainerOptions, options, option_fields),
            publish=self.publish_weights, ledger=self.ledger)
        self._training_clients.append(client)
        return client

    def create_lora_training_client(
        self, rank: int = 32, alpha: float = 32.0, train_attn: bool = True,
        train_mlp: bool = True, train_unembed: bool = False, seed: int | None = None,
        options: TrainerOptions | None = None, **option_fields: Any,
    ) -> TrainingClient[SamplingClient]:
        """A trainer of LoRA adapters of `rank` on `train_model`, whose weights stay frozen
        and shared (not copied): on the attention projections (q, k, v, o) with
        `train_attn`, the MLP's (gate, up, down; a mixture's every expert's) with
        `train_mlp`, the output head with
        `train_unembed`. The update is scaled by alpha / rank (PEFT's rule), so the
        default alpha=32 keeps a learning rate tuned at one rank about right at another.
        A is drawn from `seed` (default: the service's seed), B starts at zero.
        Publishing copies only the adapters; `save_weights_for_sampler(path)` writes
        them in PEFT's format. `options` as `create_training_client`."""
        spec = LoraSpec(rank=rank, alpha=alpha, train_attn=train_attn, train_mlp=train_mlp,
                        train_unembed=train_unembed)
        lora = add_lora(self.train_model, spec, self._seed if seed is None else seed)

        def save_for_sampler(path: str) -> str:
            return peft_format.save_adapter(path, lora, spec, self.model_name)

        client: TrainingClient[SamplingClient] = TrainingClient(
            lora, _options(TrainerOptions, options, option_fields),
            publish=lambda check: self._publish_adapters(frozen_copy(lora), check),
            ledger=self.ledger,
            params=[p for a in lora_adapters(lora).values() for p in a.parameters()],
            state_module=adapter_module(lora), save_for_sampler=save_for_sampler,
        )
        self._training_clients.append(client)
        return client

    def usage(self) -> Usage:
        return self.ledger.total()

    def seconds(self) -> dict[str, float]:
        """Seconds the engine and the trainers spent per phase (`usage.SECONDS_PHASES`)."""
        return self.ledger.seconds()

    def cache_stats(self) -> dict[str, int]:
        """block_size, capacity_bytes (the KV pool), used_bytes and num_blocks (cached),
        running/free/reserved blocks, query/hit tokens, insertions, evictions."""
        return {"enabled": int(self.engine.options.prefix_cache), **self.engine.cache_stats()}

    def engine_stats(self) -> dict[str, int]:
        """Engine counters: prefill calls/positions, decode steps, max batch size, ..."""
        return self.engine.stats()

    def check_cache_integrity(self) -> None:
        self.engine.check_integrity()

    def close(self) -> None:
        self.engine.close()
        for client in self._training_clients:
            client.close()
        self._packer.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@torch.no_grad()
def _own_storage(snapshot: Transformer, trained: Transformer) -> None:
    """Copy any tensor of `snapshot` still on `trained`'s storage (a weight shared for
    packing that was not packed), so that training never changes a published version."""
    theirs = {p.untyped_storage().data_ptr() for p in trained.parameters()}
    for param in snapshot.parameters():
        if param.untyped_storage().data_ptr() in theirs:
            param.data = param.data.clone()


def _build_model(model: str | ModelConfig | Transformer, dtype: torch.dtype, seed: int) -> Transformer:
    if isinstance(model, Transformer):
        return model
    if isinstance(model, ModelConfig):
        built = Transformer(model)
        init_weights(built, seed)
        return built.to(dtype)
    if isinstance(model, str):
        return load_model(model, dtype=dtype, seed=seed)
    raise ValueError(
        f"model must be a preset name, a checkpoint directory, a ModelConfig or a Transformer; "
        f"got {type(model).__name__}"
    )


OptionsT = TypeVar("OptionsT", SamplerOptions, TrainerOptions)


def _options(kind: type[OptionsT], given: OptionsT | None, fields: dict[str, Any]) -> OptionsT:
    """`given`, or a `kind` built from `fields` (its field names as keywords)."""
    if given is not None and fields:
        raise TypeError(f"pass a {kind.__name__} or its fields ({', '.join(sorted(fields))}), "
                        "not both")
    if given is not None:
        return given
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise TypeError(f"unknown {kind.__name__} field(s) {', '.join(unknown)}; its fields: "
                        f"{', '.join(sorted(names))}")
    return kind(**fields)
