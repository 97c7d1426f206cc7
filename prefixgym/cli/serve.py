"""`prefixgym serve`: run the built-in engine behind an OpenAI-compatible HTTP API.

Parses `ServeConfig` flags, builds a `LocalService`, and runs `serving.app` under
uvicorn until interrupted. The API key comes from `--api-key`, else the
PREFIXGYM_API_KEY environment variable; binding beyond loopback without one prints a
warning. The endpoint and its extras are described in `prefixgym/serving/app.py` and
docs/scaling.md.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from prefixgym.cli.errors import error_line
from prefixgym.cli.flags import parse_config
from prefixgym.serving.config import API_KEY_VARIABLE, ServeConfig


def main(argv: list[str]) -> int:
    config = parse_config(
        ServeConfig, argv, prog="prefixgym serve",
        description="Serve the built-in engine (with its prefix cache) on OpenAI-compatible "
        "/v1/completions (token ids in and out) and /v1/chat/completions (messages through "
        "the chat template) endpoints, cached tokens in usage.",
    )
    if not config.api_key and os.environ.get(API_KEY_VARIABLE):
        config = dataclasses.replace(config, api_key=os.environ[API_KEY_VARIABLE])
    if not config.api_key and not config.is_loopback:
        print(f"prefixgym serve: warning: {config.host} is reachable from other machines and "
              f"no API key is set: anyone who reaches port {config.port} can use the engine "
              f"(set {API_KEY_VARIABLE} or --api-key)", file=sys.stderr)
    try:
        import uvicorn

        from prefixgym.serving.app import create_app
    except ImportError as e:
        print(f"prefixgym serve needs fastapi and uvicorn: pip install 'prefixgym[serve]' ({e})",
              file=sys.stderr)
        return 2
    from prefixgym.engine.device import describe_device
    from prefixgym.local_service import LocalService

    try:
        service = LocalService(model=config.model, seed=config.seed, device=config.device,
                               prefix_cache=config.prefix_cache)
    except (ValueError, OSError) as e:
        print(f"prefixgym serve: cannot load model {config.model!r}: {error_line(e)}",
              file=sys.stderr)
        return 2
    try:
        app = create_app(service, service.tokenizer, config)
        server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                               log_level=config.log_level))
        print(f"prefixgym serve: {config.model_name} on http://{config.host}:{config.port}/v1, "
              f"{describe_device(service.device)}", flush=True)
        server.run()
    except KeyboardInterrupt:  # uvicorn shuts down first, then passes Ctrl-C on
        pass
    finally:
        service.close()
    return 0
