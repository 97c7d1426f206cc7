"""`prefixgym serve`: run the built-in engine behind an OpenAI-compatible HTTP API.

Parses `ServeConfig` flags, builds a `LocalService`, and runs `serving.app` under
uvicorn until interrupted. The API key comes from `--api-key`, else the
PREFIXGYM_API_KEY environment variable; binding beyond loopback without one prints a
warning. The endpoint and its extras are described in `prefixgym/serving/app.py` and
docs/scaling.md. With `--engine vllm` it writes the model as a Hugging Face directory
(a preset included) and runs a real vLLM server on it in the foreground instead
(`serving.launch`), ending vLLM's whole process group when interrupted.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

from prefixgym.cli.chat_template import missing_template_line, read_template_file
from prefixgym.cli.errors import error_line
from prefixgym.cli.flags import parse_config
from prefixgym.serving.config import ServeConfig, with_api_key


def main(argv: list[str]) -> int:
    config = parse_config(
        ServeConfig, argv, prog="prefixgym serve",
        description="Serve the built-in engine (with its prefix cache) on OpenAI-compatible "
        "/v1/completions (token ids in and out) and /v1/chat/completions (messages through "
        "the chat template) endpoints, cached tokens in usage.",
    )
    config = with_api_key(config, "prefixgym serve", "use the engine")
    if config.engine == "vllm":
        return serve_vllm(config)
    try:
        import uvicorn

        from prefixgym.serving.app import create_app
    except ImportError as e:
        print(f"prefixgym serve needs fastapi and uvicorn: pip install 'prefixgym[serve]' ({e})",
              file=sys.stderr)
        return 2
    from prefixgym.engine.device import describe_device
    from prefixgym.engine.sampler.options import DEFAULT_CACHE_BYTES, SamplerOptions
    from prefixgym.local_service import LocalService

    try:
        template = read_template_file(config.chat_template)
    except ValueError as e:
        print(f"prefixgym serve: {e}", file=sys.stderr)
        return 2
    try:
        options = SamplerOptions(prefix_cache=config.prefix_cache, cache_bytes=int(
            config.kv_cache_gib * 2**30) if config.kv_cache_gib else DEFAULT_CACHE_BYTES)
        dtype = "float32" if config.dtype == "auto" else config.dtype
        service = LocalService(model=config.model, seed=config.seed, device=config.device,
                               dtype=dtype, sampler=options)
    except (ValueError, OSError) as e:
        print(f"prefixgym serve: cannot load model {config.model!r}: {error_line(e)}",
              file=sys.stderr)
        return 2
    if template is not None:
        service.tokenizer.chat_template = template
    elif not service.tokenizer.chat_template:  # /v1/completions serves it all the same
        print(f"prefixgym serve: /v1/chat/completions needs a chat template: "
              f"{missing_template_line(config.model)}", file=sys.stderr)
    try:
        app = create_app(service, service.tokenizer, config)
        server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                               log_level=config.log_level))
        print(f"prefixgym serve: {config.model_name} on http://{config.host}:{config.port}/v1, "
              f"{describe_device(service.device)}, {dtype}", flush=True)
        server.run()
    except KeyboardInterrupt:  # uvicorn shuts down first, then passes Ctrl-C on
        pass
    finally:
        service.close()
    return 0


def serve_vllm(config: ServeConfig) -> int:
    """`--engine vllm`: the model in a temporary HF directory, vLLM serving it until
    interrupted."""
    from prefixgym.serving.launch import (
        ServerProcess,
        VLLMLaunch,
        find_vllm_python,
        free_port,
    )

    try:
        python = find_vllm_python(config.vllm_python)
        launch = VLLMLaunch(
            model_dir="", served_model_name=config.model_name, host=config.host,
            port=config.port or free_port(), lora_rank=config.lora_rank, dtype=config.dtype,
            block_size=config.block_size, kv_cache_gib=int(config.kv_cache_gib) or 1,
            seed=config.seed, api_key=config.api_key)
    except ValueError as e:
        print(f"prefixgym serve: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="prefixgym-vllm-") as tmp:
        try:
            model_dir = hf_model_dir(config.model, config.seed, Path(tmp) / "model")
        except (ValueError, OSError) as e:
            print(f"prefixgym serve: cannot load model {config.model!r}: {error_line(e)}",
                  file=sys.stderr)
            return 2
        launch = dataclasses.replace(launch, model_dir=model_dir)
        url = f"http://{'127.0.0.1' if config.host == '0.0.0.0' else config.host}:{launch.port}"
        print(f"prefixgym serve: starting vLLM ({python}) on {model_dir}", flush=True)
        server = ServerProcess(launch.argv(python), url, launch.env(), name="vLLM")
        try:
            server.wait_ready()
            print(f"prefixgym serve: vLLM serves {config.model_name} on "
                  f"http://{config.host}:{launch.port}/v1", flush=True)
            code = server.process.wait()
            print(f"prefixgym serve: vLLM exited with code {code}", file=sys.stderr)
            return 1
        except RuntimeError as e:
            print(f"prefixgym serve: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
        finally:
            server.stop()


def hf_model_dir(model: str, seed: int, directory: Path) -> str:
    """`model` as a directory vLLM can serve: a checkpoint directory with its tokenizer
    as it is (a .gguf file's converted one), else (a preset, or a directory without
    tokenizer files) written to `directory` with the tokenizer prefixgym uses for it."""
    from prefixgym.engine.model.gguf_import import checkpoint_dir_of, is_gguf_path
    from prefixgym.local_service import LocalService

    path = checkpoint_dir_of(model) if is_gguf_path(model) else Path(model)
    tokenizer_files = ("tokenizer.json", "tokenizer.model", "vocab.json")
    if path.is_dir() and any((path / name).is_file() for name in tokenizer_files):
        return str(path.resolve())
    with LocalService(model=model, seed=seed) as service:
        return str(service.save_hf_dir(directory).resolve())
