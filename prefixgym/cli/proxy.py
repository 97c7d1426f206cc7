"""`prefixgym proxy --upstream URL`: record agent programs that sample from another server.

Parses `ProxyConfig`, builds the upstream's `OpenAISamplingClient`, the tokenizer and chat
format of `--model` (which must be the upstream model's), and a `RecordingProxy`
(serving/proxy.py) over them, then serves until interrupted (Ctrl-C or SIGTERM) and
records the sessions still open. The API key comes from `--api-key`, else the
PREFIXGYM_API_KEY environment variable, as `prefixgym serve`'s does; binding beyond
loopback without one prints a warning.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from prefixgym.cli.errors import error_line
from prefixgym.cli.flags import parse_config
from prefixgym.serving.config import API_KEY_VARIABLE, is_loopback, with_api_key

if TYPE_CHECKING:
    from prefixgym.serving.proxy import RecordingProxy

UPSTREAM_KEY_VARIABLE = "PREFIXGYM_UPSTREAM_API_KEY"


@dataclass
class ProxyConfig:
    upstream: str = ""
    """The OpenAI-compatible server to sample from (required): its base URL, with or
    without /v1 (a vLLM, SGLang, or `prefixgym serve`)."""
    model: str = ""
    """The tokenizer and chat template to render calls with, the upstream model's: a
    built-in preset (tiny, small) or a local Hugging Face model directory (default: the
    upstream model's name, when it is one of those, as vLLM's is when it serves a path)."""
    upstream_model: str = ""
    """The model name sent upstream, and the one clients must send (default: the first
    model the upstream's /v1/models lists)."""
    host: str = "127.0.0.1"
    """Address to bind. The default answers this machine only; 0.0.0.0 exposes the proxy
    (give it an API key)."""
    port: int = 8100
    """TCP port (0 picks a free one)."""
    api_key: str = ""
    """Require `Authorization: Bearer KEY` on every route (default: the PREFIXGYM_API_KEY
    environment variable, which other users of this machine cannot read from the process
    list; empty: no key)."""
    upstream_api_key: str = ""
    """The key the upstream wants (default: the PREFIXGYM_UPSTREAM_API_KEY environment
    variable, else PREFIXGYM_API_KEY, as `prefixgym train --sampler-url` sends)."""
    record: str = "sessions.jsonl"
    """Where each finished session's trained sequences are appended, one JSON line each."""
    max_tokens: int = 1024
    """Tokens per reply, for calls that do not set max_tokens."""
    temperature: float = 1.0
    """Sampling temperature, for calls that do not set one."""

    def __post_init__(self) -> None:
        if not self.upstream.startswith(("http://", "https://")):
            raise ValueError("--upstream is required: the base URL of an OpenAI-compatible "
                             f"server, http://HOST:PORT[/v1], got {self.upstream!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not self.record:
            raise ValueError("--record must name a file")

    @property
    def is_loopback(self) -> bool:
        """Whether `host` answers this machine only (`prefixgym serve`'s rule)."""
        return is_loopback(self.host)


def main(argv: list[str]) -> int:
    config = parse_config(
        ProxyConfig, argv, prog="prefixgym proxy",
        description="Serve the agent gateway's OpenAI routes in front of another "
        "OpenAI-compatible server, recording each session's calls token for token: "
        "/rollouts/KEY/v1/... (a session per KEY, opened by its first call, ended by POST "
        "/rollouts/KEY/close) and /v1/... (the session 'default', ended by POST /v1/close).",
    )
    config = with_api_key(config, "prefixgym proxy", "sample from the upstream")
    try:
        import fastapi  # noqa: F401 - the gateway's app and server
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"prefixgym proxy needs fastapi and uvicorn: pip install 'prefixgym[serve]' ({e})",
              file=sys.stderr)
        return 2
    try:
        proxy = build_proxy(config)
        url = proxy.start(config.port)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"prefixgym proxy: {error_line(e)}", file=sys.stderr)
        return 2
    print(f"prefixgym proxy: {url}/v1 and {url}/rollouts/KEY/v1 -> {config.upstream} "
          f"({proxy.gateway.model}), recording to {config.record}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    finally:
        proxy.stop()
        print(f"prefixgym proxy: {proxy.recorded} sequences recorded to {config.record}",
              file=sys.stderr)
    return 0


def build_proxy(config: ProxyConfig) -> RecordingProxy:
    """The proxy `config` describes, not yet serving; ValueError for what it cannot build
    (an upstream that cannot say its model, a tokenizer that cannot be found)."""
    from prefixgym.prompting.call_tree import CallTree
    from prefixgym.prompting.conversation import chat_format_for
    from prefixgym.serving.agent_session import SamplingDefaults
    from prefixgym.serving.openai_client import OpenAISamplingClient
    from prefixgym.serving.proxy import RecordingProxy

    upstream_key = (config.upstream_api_key or os.environ.get(UPSTREAM_KEY_VARIABLE)
                    or os.environ.get(API_KEY_VARIABLE) or "EMPTY")
    sampler = OpenAISamplingClient(config.upstream, model=config.upstream_model or None,
                                   api_key=upstream_key)
    try:
        model = sampler.model
    except (ValueError, RuntimeError, ConnectionError) as e:
        raise ValueError(f"cannot ask {sampler.base_url}/models for the upstream's model "
                         f"(or give --upstream-model): {error_line(e)}") from None
    tokenizer = tokenizer_for(config.model or model, given=bool(config.model))
    fmt = chat_format_for(tokenizer)
    defaults = SamplingDefaults(max_tokens=config.max_tokens, temperature=config.temperature)
    return RecordingProxy(sampler, model, lambda: CallTree(tokenizer, fmt), config.record,
                          defaults, config.api_key or None, config.host)


def tokenizer_for(model: str, given: bool = True) -> PreTrainedTokenizerBase:
    """The tokenizer of `model`, as `LocalService` picks it: a preset's is the built-in
    one, a checkpoint directory's (or a .gguf file's converted one) its own. ValueError
    for anything else."""
    from prefixgym.engine.model.config import PRESETS
    from prefixgym.engine.model.gguf_import import checkpoint_dir_of, is_gguf_path
    from prefixgym.prompting.tokenizer import resolve_tokenizer

    if model in PRESETS:
        return resolve_tokenizer(None)
    if is_gguf_path(model):
        return resolve_tokenizer(None, checkpoint_dir_of(model))
    if Path(model).is_dir():
        return resolve_tokenizer(None, model)
    where = "--model" if given else f"the upstream's model {model!r} (give --model)"
    raise ValueError(f"{where}: not a built-in preset ({', '.join(sorted(PRESETS))}), a "
                     "local directory with the upstream model's tokenizer nor a .gguf file")
