"""`prefixgym train`: parse flags into a TrainConfig, build the clients, run it.

The only place that turns a TrainConfig into services and clients: a `LocalService`
for training (and sampling, unless `--sampler-url` points rollouts and evaluation at
an OpenAI-compatible server), or with `--backend tinker` the hosted service's clients
behind our protocols (`prefixgym.tinker.backend`), the envs from `--env`/`--env-kwargs`,
then `trainer.run.Run` with all of them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from prefixgym.cli.flags import build_config, build_parser, read_config_file, read_json_object
from prefixgym.engine.device import has_fast_bf16
from prefixgym.engine.training import TrainingClient
from prefixgym.envs.registration import absolute_spec, make_agent_env
from prefixgym.local_service import LocalService
from prefixgym.prompting.chat_format import ChatMLFormat
from prefixgym.prompting.conversation import chat_format_for
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


def build_run(config: TrainConfig, service: LocalService | None = None,
              tinker_service: Any = None) -> tuple[Run, LocalService | None]:
    """The run of `config` and the service it trains on (built here unless given; none
    with `--backend tinker`, whose tinker `ServiceClient` may be given instead)."""

    def make() -> AgentGymEnv:
        return make_agent_env(config.env, config.env_kwargs)

    make().close()  # a bad --env fails before the model loads
    if config.backend == "tinker":
        return Run(config, tinker_clients(config, tinker_service), make), None
    service = service or LocalService(
        model=config.model, seed=config.seed, num_threads=config.num_threads or None
    )
    if Path(config.model).is_dir():
        check_chat_format(config.model, service)
    if config.lora_rank:
        targets = {t.strip() for t in config.lora_targets.split(",")}
        training = service.create_lora_training_client(
            rank=config.lora_rank, alpha=config.lora_alpha, train_attn="attn" in targets,
            train_mlp="mlp" in targets, train_unembed="unembed" in targets, seed=config.seed,
            compute_dtype=compute_dtype(config), share_prefixes=config.share_prefixes)
    else:
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


def tinker_clients(config: TrainConfig, service_client: Any = None) -> Clients:
    """Clients on the hosted service (docs/tinker.md): a LoRA trainer of `--model`."""
    from prefixgym.engine.usage import UsageLedger
    from prefixgym.tinker.backend import connect

    if service_client is None:
        if not os.environ.get("TINKER_API_KEY"):
            raise ValueError("--backend tinker needs the service's API key in TINKER_API_KEY")
        import tinker

        service_client = tinker.ServiceClient()
    ledger = UsageLedger()
    rank = config.lora_rank or 32
    trainer, sampler, tokenizer = connect(service_client, config.model, rank, config.seed,
                                          ledger)
    return Clients(trainer, sampler, tokenizer, ledger.total)


def check_chat_format(directory: str, service: LocalService) -> None:
    """Say which chat format a checkpoint's runs use; ValueError if its template is not
    append-only (prompts are built by appending tokens; docs/lora.md)."""
    try:
        fmt = chat_format_for(service.tokenizer)
    except ValueError as e:  # TemplateNotAppendOnlyError, or no template at all
        raise ValueError(f"--model {directory}: its chat template cannot be used: {e}") from None
    kind = ("the built-in ChatML format" if isinstance(fmt, ChatMLFormat)
            else "its tokenizer's chat template (append-only)")
    print(f"--model {directory}: conversations use {kind}", file=sys.stderr)


def save_lora_adapter(config: TrainConfig, run: Run, out: Path) -> str | None:
    """With a LoRA run, write its adapter to OUT/adapter (PEFT format); its path."""
    training = run.clients.training
    if config.sampler_url:
        from prefixgym.serving.openai_client import RemoteSamplingTrainer

        if isinstance(training, RemoteSamplingTrainer):
            training = training.training
    if not config.lora_rank or not isinstance(training, TrainingClient):
        return None
    return training.save_weights_for_sampler(out / "adapter").result()


def train(config: TrainConfig, service: LocalService | None = None) -> RunResult:
    """Run `config` end to end; print the evaluations as one JSON line."""
    run, _ = build_run(config, service)
    result = run.run()
    adapter = save_lora_adapter(config, run, result.out)
    if adapter is not None:
        print(f"adapter: {adapter}", file=sys.stderr)
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
