"""The one config of `prefixgym serve`; each field's docstring is its `--help` text."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import sys
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

API_KEY_VARIABLE = "PREFIXGYM_API_KEY"


BUILT_IN_DTYPES = ("auto", "float32", "bfloat16", "float16")
"""What `--dtype` may say for the built-in engine."""

@dataclass
class ServeConfig:
    model: str = "tiny"
    """A built-in preset (tiny, small), a local Hugging Face checkpoint directory or a
    .gguf file (converted once to a cached directory; `pip install 'prefixgym[gguf]'`)."""
    chat_template: str = ""
    """A chat template for /v1/chat/completions instead of --model's own (a base model's
    GGUF file often has none): a .jinja file, a tokenizer_config.json or a model
    directory (the built-in engine's)."""
    engine: str = "prefixgym"
    """prefixgym (the built-in engine, in this process) or vllm (a real vLLM server in a
    child process, started with the flags RL needs: docs/scaling.md). Flags marked
    (vllm) are vLLM's alone; --max-request-tokens, --max-n, --max-body-bytes and
    --log-level are the built-in engine's."""
    host: str = "127.0.0.1"
    """Address to bind. The default answers this machine only; 0.0.0.0 exposes the engine
    (give it an API key)."""
    port: int = 8000
    """TCP port (0 picks a free one)."""
    seed: int = 0
    """Seed of the model init and of requests that give no seed."""
    device: str = "auto"
    """Where the model runs: cpu, cuda, cuda:N, mps, or auto (a GPU when torch sees
    one, else the CPU)."""
    served_model_name: str = ""
    """The model id clients send and /v1/models lists (default: --model)."""
    max_request_tokens: int = 0
    """Prompt tokens + max_tokens allowed per request (0 = the model's context length)."""
    max_n: int = 64
    """Samples per request at most."""
    max_body_bytes: int = 4 * 2**20
    """Largest request body accepted, in bytes."""
    prefix_cache: bool = True
    """Keep the prefix KV cache (off: every prompt is prefilled in full)."""
    log_level: str = "warning"
    """uvicorn's log level."""
    api_key: str = ""
    """Require `Authorization: Bearer KEY` on the /v1 routes, as OpenAI-compatible servers
    do (default: the PREFIXGYM_API_KEY environment variable, which other users of this
    machine cannot read from the process list; empty: no key)."""

    vllm_python: str = ""
    """(vllm) A Python that has vLLM installed (default: $PREFIXGYM_VLLM_PYTHON, else
    .venv-vllm/bin/python here, which `./run.sh vllm` builds, else this Python)."""
    lora_rank: int = 16
    """(vllm) Largest rank of the LoRA adapters it takes at runtime (0: none)."""
    dtype: str = "auto"
    """The weights' and activations' dtype: float32, bfloat16 or float16 (float32 to
    match an fp32 trainer); auto: float32 for the built-in engine, the checkpoint's own
    for vLLM."""
    block_size: int = 32
    """(vllm) KV block size; prefixes are cached in whole blocks."""
    kv_cache_gib: float = 0.0
    """KV cache size in GiB: the built-in engine's KV pool (0: 0.25), or vLLM's on a CPU
    (whole GiB; 0: 1)."""

    def __post_init__(self) -> None:
        if self.engine not in ("prefixgym", "vllm"):
            raise ValueError(f"--engine must be prefixgym or vllm, got {self.engine!r}")
        if self.kv_cache_gib < 0 or (self.engine == "vllm" and not self.kv_cache_gib.is_integer()):
            raise ValueError("--kv-cache-gib must be >= 0, and whole with --engine vllm, got "
                             f"{self.kv_cache_gib}")
        if self.engine == "vllm" and self.chat_template:
            raise ValueError("--chat-template is the built-in engine's; vLLM reads the "
                             "template of the model directory it serves")
        if self.engine == "prefixgym" and self.dtype not in BUILT_IN_DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(BUILT_IN_DTYPES)} for the "
                             f"built-in engine, got {self.dtype!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_request_tokens < 0:
            raise ValueError(f"--max-request-tokens must be >= 0, got {self.max_request_tokens}")
        if self.max_n < 1:
            raise ValueError(f"--max-n must be at least 1, got {self.max_n}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def is_loopback(self) -> bool:
        """Whether `host` answers this machine only."""
        return is_loopback(self.host)


class _Bound(Protocol):
    """A command's config that binds an address (ServeConfig, the proxy's)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]
    api_key: str

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...

    @property
    def is_loopback(self) -> bool: ...


_Guarded = TypeVar("_Guarded", bound=_Bound)


def with_api_key(config: _Guarded, command: str, exposes: str) -> _Guarded:
    """`config` with its API key from `API_KEY_VARIABLE` when the flag gave none, after
    warning on stderr when it binds beyond this machine without one (`exposes`: what an
    outsider could then use)."""
    if not config.api_key and os.environ.get(API_KEY_VARIABLE):
        config = dataclasses.replace(config, api_key=os.environ[API_KEY_VARIABLE])
    if not config.api_key and not config.is_loopback:
        print(f"{command}: warning: {config.host} is reachable from other machines and no API "
              f"key is set: anyone who reaches port {config.port} can {exposes} (set "
              f"{API_KEY_VARIABLE} or --api-key)", file=sys.stderr)
    return config


def is_loopback(host: str) -> bool:
    """Whether `host` answers this machine only (a host name: assume it reaches beyond)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
