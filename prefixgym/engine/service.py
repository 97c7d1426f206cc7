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

import os
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Self

import torch

from prefixgym.engine import peft_format
from prefixgym.engine.checkpoint_io import nonfinite_tensor
from prefixgym.engine.engine import Engine
from prefixgym.engine.kv_pool import KVPool
from prefixgym.engine.lora import (
    LoraSpec,
    adapter_module,
    add_lora,
    frozen_copy,
    frozen_view,
    lora_adapters,
)
from prefixgym.engine.model import ModelConfig, Transformer, init_weights, load_model
from prefixgym.engine.prefix_cache import PrefixCache
from prefixgym.engine.requests import DEFAULT_MAX_KV_BYTES, DEFAULT_MAX_RUNNING, RequestLimits
from prefixgym.engine.sampling import SamplingClient
from prefixgym.engine.usage import UsageLedger
from prefixgym.types import Usage

if TYPE_CHECKING:
    from prefixgym.engine.training import TrainingClient

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineService:
    """The local engine. `model`: a preset name, a local HF checkpoint directory, a
    `ModelConfig` (randomly initialised with `seed`) or a `Transformer` (used as is).

    `end_of_turn_ids`: token ids every sampling client stops at by default (ids
    outside the model's vocabulary are dropped). `decode`: ids -> text, needed only
    for requests with stop strings. `prefix_cache=False` runs the same engine without cache reads or writes.
    `cache_bytes`: the KV pool, preallocated on `device` (pages are touched as blocks are
    first used): running sequences' KV and the cached blocks, in `block_size` blocks.
    `device`: where the models, the KV pool and every engine and training tensor live
    ("cpu", "cuda", "cuda:1", "mps", ... as torch knows them).
    `num_threads` sets torch's intra-op threads (process-wide) only when given.
    `thread_tuning` lets the engine run each kind of step on the thread count (up to
    torch's count at construction) that it measured fastest (`engine/threads.py`).
    `max_running` bounds the sequences decoding at once, and so a request's samples;
    `max_kv_bytes` the running KV one request may need (`engine/requests.py`).
    `deterministic` runs each `sample_many` round alone, so that a caller submitting
    its work in fixed rounds gets the same logprobs, bit for bit, every run
    (`engine/engine.py`); with a bf16/fp16 model on CPU it also turns thread tuning off.
    """

    def __init__(
        self,
        model: str | ModelConfig | Transformer = "tiny",
        seed: int = 0,
        prefix_cache: bool = True,
        block_size: int = 16,
        cache_bytes: int = 2**30,
        dtype: str | torch.dtype = "float32",
        end_of_turn_ids: Iterable[int] = (),
        decode: Callable[[list[int]], str] | None = None,
        num_threads: int | None = None,
        max_running: int = DEFAULT_MAX_RUNNING,
        thread_tuning: bool = True,
        max_kv_bytes: int = DEFAULT_MAX_KV_BYTES,
        deterministic: bool = False,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        torch_dtype = _DTYPES.get(dtype) if isinstance(dtype, str) else dtype
        if torch_dtype is None or torch_dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        try:
            self.device = torch.device(device)
            torch.empty(0, device=self.device)
        except (RuntimeError, AssertionError) as error:  # torch's words, in one line
            raise ValueError(f"device {device!r} is not usable here: {error}") from error
        self.train_model = _build_model(model, torch_dtype, seed).to(self.device)
        self.model_name = model if isinstance(model, str) else ""
        self._seed = seed
        cfg = self.train_model.config
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        # CPU attention is fastest in fp32 (exact for bf16 values: docs/benchmarks.md)
        kv_dtype = torch.float32 if self.device.type == "cpu" else torch_dtype
        kv_element_size = torch.empty((), dtype=kv_dtype).element_size()
        block_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * block_size * cfg.head_dim * (
            kv_element_size)
        num_blocks = cache_bytes // block_bytes
        if num_blocks < 2:
            raise ValueError(f"cache_bytes={cache_bytes} holds {num_blocks} KV blocks of "
                             f"{block_bytes} bytes; the engine needs at least 2")
        pool = KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, num_blocks, block_size,
                      kv_dtype, self.device)
        self._prefix_cache = prefix_cache
        cache = PrefixCache(num_blocks, block_size, block_bytes, indexing=prefix_cache)
        self.ledger = UsageLedger()
        limits = RequestLimits(max_samples=max_running, max_kv_bytes=max_kv_bytes,
                               kv_element_size=kv_element_size)
        # bf16/fp16 matmuls on a CPU run in oneDNN, whose rounding changes with the thread
        # count (docs/architecture.md "Determinism"): a deterministic engine keeps one count
        if deterministic and self.device.type == "cpu" and torch_dtype != torch.float32:
            thread_tuning = False
        self.engine = Engine(pool, cache, decode=decode, ledger=self.ledger, seed=seed,
                             max_running=max_running, thread_tuning=thread_tuning,
                             limits=limits, deterministic=deterministic)
        self._default_stop_ids = tuple(
            dict.fromkeys(int(i) for i in end_of_turn_ids if 0 <= int(i) < cfg.vocab_size))
        self._lock = threading.Lock()
        self._version = 0  # the latest published version
        self._last_version_id = 0  # every version's id is new, published or loaded
        # Version 0 shares the loaded weights until a full training client is created
        # (LoRA leaves them untouched): the loaded weights are held once, not twice.
        self._inference_model = frozen_view(self.train_model)
        self._weights_shared = True
        self._training_clients: list[TrainingClient] = []

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
            with self._lock:
                self._last_version_id += 1
                version = self._last_version_id
            return SamplingClient(self.engine, lora, version, default_stop_token_ids=stop_ids)
        with self._lock:
            model, version = self._inference_model, self._version
        return SamplingClient(self.engine, model, version, default_stop_token_ids=stop_ids)

    def publish_weights(self) -> SamplingClient:
        """Snapshot `train_model` as a new frozen weights version; a client for it.
        Refuses (ValueError) weights holding NaN or inf: nothing would sample from them."""
        return self._publish(self.train_model.clone_for_inference())

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
        changed: Iterable[tuple[str, torch.Tensor]] | None = None,
    ) -> SamplingClient:
        """Make `snapshot` the latest version, unless a tensor of `changed` (default:
        all its parameters) holds NaN or inf. A LoRA snapshot passes its adapters only:
        the frozen base it shares cannot have changed, and scanning 2 GB of it took
        seconds per publish on a 0.5B model."""
        tensors = snapshot.named_parameters() if changed is None else changed
        bad = nonfinite_tensor(tensors)
        if bad is not None:
            raise ValueError(f"not publishing weights: {bad} holds NaN or inf values")
        with self._lock:
            self._last_version_id += 1
            self._version = self._last_version_id
            self._inference_model = snapshot
        return self.create_sampling_client()

    def _publish_adapters(self, snapshot: Transformer) -> SamplingClient:
        return self._publish(snapshot, (
            (f"{key}.{name}", tensor) for key, adapter in lora_adapters(snapshot).items()
            for name, tensor in adapter.named_parameters()))

    def create_training_client(
        self, compute_dtype: torch.dtype = torch.float32, nonfinite_update: str = "skip",
        share_prefixes: bool = True, chunked_head: bool = True,
        recompute_activations: bool = False,
    ) -> TrainingClient:
        """A trainer on `train_model`; `compute_dtype=torch.bfloat16` runs its matmuls in
        bf16 under autocast (fp32 master weights and optimizer state). An update with a
        non-finite gradient norm is skipped, or with `nonfinite_update="error"` raises.
        With `share_prefixes`, a token prefix shared by datums of one call is computed
        once (same results); False computes every datum's every position (the reference).
        `chunked_head` (never all positions' logits at once) and `recompute_activations`
        (checkpoint every block: ~1/3 more compute, far fewer activations held) trade
        compute for memory with the same results (docs/lora.md, "Memory")."""
        from prefixgym.engine.training import TrainingClient

        self._unshare_weights()
        client = TrainingClient(self.train_model, publish=self.publish_weights, ledger=self.ledger,
                                compute_dtype=compute_dtype, nonfinite_update=nonfinite_update,
                                share_prefixes=share_prefixes, chunked_head=chunked_head,
                                recompute_activations=recompute_activations)
        self._training_clients.append(client)
        return client

    def create_lora_training_client(
        self, rank: int = 32, alpha: float = 32.0, train_attn: bool = True,
        train_mlp: bool = True, train_unembed: bool = False, seed: int | None = None,
        compute_dtype: torch.dtype = torch.float32, nonfinite_update: str = "skip",
        share_prefixes: bool = True, chunked_head: bool = True,
        recompute_activations: bool = False,
    ) -> TrainingClient:
        """A trainer of LoRA adapters of `rank` on `train_model`, whose weights stay frozen
        and shared (not copied): on the attention projections (q, k, v, o) with
        `train_attn`, the MLP's (gate, up, down) with `train_mlp`, the output head with
        `train_unembed`. The update is scaled by alpha / rank (PEFT's rule), so the
        default alpha=32 keeps a learning rate tuned at one rank about right at another.
        A is drawn from `seed` (default: the service's seed), B starts at zero.
        Publishing copies only the adapters; `save_weights_for_sampler(path)` writes
        them in PEFT's format. Other arguments as `create_training_client`."""
        from prefixgym.engine.training import TrainingClient

        spec = LoraSpec(rank=rank, alpha=alpha, train_attn=train_attn, train_mlp=train_mlp,
                        train_unembed=train_unembed)
        lora = add_lora(self.train_model, spec, self._seed if seed is None else seed)
        adapters = adapter_module(lora)

        def save_for_sampler(path: str) -> str:
            return peft_format.save_adapter(path, lora, spec, self.model_name)

        client = TrainingClient(
            lora, publish=lambda: self._publish_adapters(frozen_copy(lora)), ledger=self.ledger,
            compute_dtype=compute_dtype, nonfinite_update=nonfinite_update,
            share_prefixes=share_prefixes, chunked_head=chunked_head,
            recompute_activations=recompute_activations,
            params=[p for a in lora_adapters(lora).values() for p in a.parameters()],
            state_module=adapters, save_for_sampler=save_for_sampler,
        )
        self._training_clients.append(client)
        return client

    def usage(self) -> Usage:
        return self.ledger.total()

    def cache_stats(self) -> dict[str, int]:
        """block_size, capacity_bytes (the KV pool), used_bytes and num_blocks (cached),
        running/free/reserved blocks, query/hit tokens, insertions, evictions."""
        return {"enabled": int(self._prefix_cache), **self.engine.cache_stats()}

    def engine_stats(self) -> dict[str, int]:
        """Engine counters: prefill calls/positions, decode steps, max batch size, ..."""
        return self.engine.stats()

    def check_cache_integrity(self) -> None:
        self.engine.check_integrity()

    def close(self) -> None:
        self.engine.close()
        for client in self._training_clients:
            client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
