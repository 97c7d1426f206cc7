"""`prefixgym train`: parse flags into a TrainConfig, build the clients, run it.

The only place that turns a TrainConfig into services and clients: a `LocalService`
for training (and sampling, unless `--sampler-url` points rollouts and evaluation at
an OpenAI-compatible server), the envs from `--env`/`--env-kwargs`, then
`trainer.run.Run` with all of them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from prefixgym.cli.flags import build_config, build_parser, read_config_file, read_json_object
from prefixgym.engine.device import has_fast_bf16
from prefixgym.envs.registration import absolute_spec, make_agent_env
from prefixgym.local_service import LocalService
from prefixgym.rollouts.episode import AgentGymEnv
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.run import RUN_CONFIG, Clients, Run, RunResult
from prefixgym.types import JSONObject

FLAG_NAMES = {"async_mode": "async", "lr": "lr"}


def compute_dtype(config: TrainConfig) -> torch.dtype:
    """`--compute-dtype`, with auto decided for this machine."""
    if config.compute_dtype == "auto":
        return torch.bfloat16 if has_fast_bf16() else torch.float32
    return torch.bfloat16 if config.compute_dtype == "bfloat16" else torch.float32


def build_run(config: TrainConfig, service: LocalService | None = None) -> tuple[Run, LocalService]:
    """The run of `config` and the service it trains on (built here unless given)."""

    def make() -> AgentGymEnv:
        return make_agent_env(config.env, config.env_kwargs)

    make().close()  # a bad --env fails before the model loads
    service = service or LocalService(
        model=config.model, seed=config.seed, num_threads=config.num_threads or None,
        deterministic=config.deterministic,
    )
    training = service.create_training_client(compute_dtype=compute_dtype(config),
                                              share_prefixes=config.share_prefixes)
    clients = Clients(training, service.create_sampling_client(), service.tokenizer,
                      service.usage)
    if config.sampler_url:  # rollouts and evaluation on a remote server (docs/scaling.md)
        from prefixgym.serving.openai_client import OpenAISamplingClient, RemoteSamplingTrainer

        remote = OpenAISamplingClient(config.sampler_url, tokenizer=service.tokenizer,
                                      ledger=service.ledger)
        clients = Clients(RemoteSamplingTrainer(training, remote), remote, service.tokenizer,
                          service.usage)
    return Run(config, clients, make), service


def train(config: TrainConfig, service: LocalService | None = None) -> RunResult:
    """Run `config` end to end; print the evaluations as one JSON line."""
    run, _ = build_run(config, service)
    result = run.run()
    print(json.dumps({f"{e['when']} (step {e['step']})": round(e["eval/success"], 3)
                      for e in result.evals}))
    return result


def main(argv: list[str]) -> int:
    parser = build_parser(
        TrainConfig, prog="prefixgym train",
        description="SFT warm start on expert episodes, then GRPO, on one env; writes "
        "metrics.jsonl, report.md, plots and checkpoints to --out. Settings come from the "
        "defaults, then a resumed run's saved config.json, then --config FILE.toml, then "
        "the flags given here.",
        flag_names=FLAG_NAMES, config_file=True,
    )
    given = vars(parser.parse_args(argv))
    try:
        from_file = (read_config_file(TrainConfig, given["config"], FLAG_NAMES)
                     if "config" in given else {})
        saved = saved_run_config({**from_file, **given})
    except ValueError as e:
        parser.error(str(e))
    config = build_config(TrainConfig, parser, saved, from_file, given)
    config.env = absolute_spec(config.env)
    try:
        result = train(config)
    except ValueError as e:
        print(f"prefixgym train: {e}", file=sys.stderr)
        return 2
    print(f"report: {result.out / 'report.md'}")
    return 0


def saved_run_config(settings: JSONObject) -> JSONObject:
    """With `resume` set, the config the run in `out` saved (nothing if it saved none)."""
    if not settings.get("resume"):
        return {}
    path = Path(settings.get("out", TrainConfig.out)) / RUN_CONFIG
    return read_json_object(path) if path.exists() else {}
