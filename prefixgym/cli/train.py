"""`prefixgym train`: build the clients of a TrainConfig (from `train_args.py`), run it.

The only place that turns a TrainConfig into services and clients: a `LocalService`
for training (and sampling, unless `--sampler-url` points rollouts and evaluation at
OpenAI-compatible servers, which then receive every update: `serving.weight_sync`),
the envs from `--env`/`--env-kwargs`, then `trainer.run.Run` with all of them.
Under torchrun (WORLD_SIZE > 1: `torchrun --nproc-per-node N -m prefixgym train ...`)
it joins the process group (NCCL where the ranks train on GPUs, one each; gloo on
CPU), wraps the training client in `DistributedTrainingClient` (`FSDPTrainingClient`
with `--fsdp`), and hands the run its `Ranks`; those parts, and the remote samplers,
are `scale_out.py`'s. A checkpoint's chat format is `chat_format.py`'s.
With `--backend tinker` the hosted service's clients stand behind our protocols
(`prefixgym.tinker.backend`) instead of a LocalService.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from prefixgym.cli.agent_source import AgentInputs, agent_source, check_agent
from prefixgym.cli.chat_format import checkpoint_chat_format
from prefixgym.cli.chat_template import read_template_file
from prefixgym.cli.errors import error_line
from prefixgym.cli.scale_out import (
    distribute,
    remote_clients,
    run_device,
    sync_mode,
    torchrun_ranks,
    unwrap,
)
from prefixgym.engine.device import describe_device, has_fast_bf16, resolve_device
from prefixgym.engine.sampler.options import SamplerOptions
from prefixgym.engine.trainer.options import TrainerOptions
from prefixgym.envs.base import has_expert, replays_its_seed
from prefixgym.envs.registration import make_agent_env
from prefixgym.files import ensure_writable_dir
from prefixgym.local_service import LocalService
from prefixgym.pricing import Prices, run_prices
from prefixgym.protocols import TrainingClient
from prefixgym.rollouts.episode import AgentGymEnv
from prefixgym.trainer.agent_steps import AgentSource
from prefixgym.trainer.clients import Clients, RunResult
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.model_defaults import pretrained_defaults_line
from prefixgym.trainer.run import Run
from prefixgym.types import JSONObject


def compute_dtype(config: TrainConfig, device: torch.device | None = None) -> torch.dtype:
    """`--compute-dtype`, with auto decided for the run's device."""
    if config.compute_dtype == "auto":
        fast = has_fast_bf16(device if device is not None else resolve_device(config.device))
        return torch.bfloat16 if fast else torch.float32
    return torch.bfloat16 if config.compute_dtype == "bfloat16" else torch.float32


def trainer_options(config: TrainConfig, device: torch.device) -> TrainerOptions:
    """The engine trainer's options from the run's flags."""
    return TrainerOptions(
        compute_dtype=compute_dtype(config, device),
        nonfinite_update="error" if config.nonfinite_update == "error" else "skip",
        share_prefixes=config.share_prefixes,
        recompute_activations=config.recompute_activations,
        router_aux_loss_coef=config.router_aux_loss_coef)


def check_env(config: TrainConfig, make: Callable[[JSONObject | None], AgentGymEnv]) -> None:
    """A bad --env (or stage env_kwargs), one without the expert its warm start needs, or
    one that ignores its reset seed, fails before the model loads."""
    env = make(None)
    try:
        if config.sft_steps and not config.sft_data and not has_expert(env):
            raise ValueError(
                f"--env {config.env} has no scripted expert (expert_action), "
                f"whose episodes the warm start (--sft-steps {config.sft_steps}) trains on; "
                "pass --sft-steps 0 to train with GRPO alone")
        try:
            replays = replays_its_seed(env)
        except Exception as e:  # noqa: BLE001 - the env's own failure, in one line
            raise ValueError(f"--env {config.env}: reset(seed=0) failed: "
                             f"{type(e).__name__}: {e}") from None
        if not replays:
            raise ValueError(
                f"--env {config.env} ignores its reset seed (reset(seed=0) twice gave two first "
                "observations): a GRPO group's samples would each play another task; make "
                "its reset honour the seed")
    finally:
        env.close()
    for i, stage in enumerate(config.sft_stages):  # and so does a stage's bad env_kwargs
        try:
            make(stage["env_kwargs"]).close()
        except ValueError as e:
            raise ValueError(f"--sft-stages: stage {i + 1}: {e}") from None


def build_run(config: TrainConfig, service: LocalService | None = None,
              tinker_service: Any = None, agent: AgentInputs | None = None,
              ) -> tuple[Run, LocalService | None]:
    """The run of `config` and the service it trains on (built here unless given; none
    with `--backend tinker`, whose tinker `ServiceClient` may be given instead); `agent`:
    an agent program and its tasks given as Python objects (`train`'s).
    1) every check that can fail before the model loads; 2) the service, and the
    checkpoint's chat format; 3) the training client, shared by the torchrun ranks;
    4) the samplers: the service's, or `--sampler-url`'s servers."""
    agent = agent or AgentInputs()

    def make(overrides: JSONObject | None = None) -> AgentGymEnv:
        return make_agent_env(config.env, {**(config.env_kwargs or {}), **(overrides or {})})

    template, pricing = check_before_load(config, agent, make)  # 1)
    if config.backend == "tinker":
        tinker = tinker_clients(config, tinker_service)
        return Run(config, tinker, make, pricing, with_agent(config, tinker, agent)), None
    service = service or LocalService(  # 2)
        model=config.model, seed=config.seed, num_threads=config.num_threads or None,
        device=run_device(config.device),
        sampler=SamplerOptions(deterministic=config.deterministic),
    )
    for line in checkpoint_chat_format(config.model, service.tokenizer, template,
                                       config.chat_template, config.chat_template_kwargs):
        print(line, file=sys.stderr)
    ranks = torchrun_ranks(service)  # 3)
    options = trainer_options(config, service.device)
    training, ranks = distribute(training_client(config, service, options), ranks,
                                 config.fsdp)
    clients = Clients(training, service.create_sampling_client(), service.tokenizer,  # 4)
                      service.usage, ranks=ranks, seconds=service.seconds)
    if config.sampler_url:  # rollouts and evaluation on remote servers (docs/scaling.md)
        clients = remote_clients(config, service, training, ranks)
    # the training worker runs on this thread's count (engine/trainer/training.py)
    clients.numerics = {"compute_dtype": str(options.compute_dtype).removeprefix("torch."),
                        "threads": torch.get_num_threads(),
                        "device": describe_device(service.device)}
    return Run(config, clients, make, pricing, with_agent(config, clients, agent)), service


def check_before_load(config: TrainConfig, agent: AgentInputs,
                      make: Callable[[JSONObject | None], AgentGymEnv]
                      ) -> tuple[str | None, tuple[Prices, str]]:
    """What fails before the model loads: the env or agent, the output directory, the
    chat template file, the prices, the trace file, and flags remote samplers cannot
    serve. Returns the template file's text (None: none given) and the run's prices."""
    if config.agent:
        check_agent(config, agent)
    else:
        check_env(config, make)
    ensure_writable_dir(Path(config.out))
    template = read_template_file(config.chat_template)
    pricing = run_prices(config.model, config.price_model, config.prices)
    if config.trace:
        try:
            open(config.trace, "w").close()  # noqa: SIM115
        except OSError as e:
            raise ValueError(f"--trace {config.trace}: cannot write it: "
                             f"{e.strerror or e}") from None
    if config.sampler_url and config.kl_coef > 0:
        raise ValueError(
            "--kl-coef needs the warm-start weights as a reference, and remote samplers keep "
            "only the newest versions: use in-process sampling for a KL penalty")
    if config.sampler_url and config.staleness and sync_mode(config) == "full":
        raise ValueError(
            "--sampler-url pushes full weights, and a server holds one weights version at a "
            "time: --async or --max-staleness (sampling from an earlier version) needs LoRA "
            "adapters (--lora-rank) or in-process sampling")
    return template, pricing


def training_client(config: TrainConfig, service: LocalService, options: TrainerOptions
                    ) -> TrainingClient:
    """The service's training client: a LoRA adapter's with `--lora-rank`, else the
    whole model's."""
    if not config.lora_rank:
        return service.create_training_client(options)
    targets = {t.strip() for t in config.lora_targets.split(",")}
    return service.create_lora_training_client(
        rank=config.lora_rank, alpha=config.lora_alpha, train_attn="attn" in targets,
        train_mlp="mlp" in targets, train_unembed="unembed" in targets, seed=config.seed,
        options=options)


def with_agent(config: TrainConfig, clients: Clients, inputs: AgentInputs
               ) -> AgentSource | None:
    """`--agent`'s rollouts, through a gateway the run stops when it ends."""
    if not config.agent:
        return None
    source, _ = agent_source(config, clients.tokenizer, inputs)
    return source


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


def save_lora_adapter(config: TrainConfig, run: Run, out: Path) -> str | None:
    """With a local LoRA run, write its adapter to OUT/adapter (PEFT format); its path.
    (With `--backend tinker` the adapter stays on the service, in its checkpoints.)"""
    if not config.lora_rank or config.backend != "local":
        return None
    return unwrap(run.clients.training).save_weights_for_sampler(out / "adapter").result()


def train(config: TrainConfig, service: LocalService | None = None, *,
          agent: Callable[..., Any] | None = None, tasks: Iterable[Any] | None = None,
          eval_tasks: Iterable[Any] | None = None,
          pretrained: JSONObject | None = None) -> RunResult:
    """Run `config` end to end; print the evaluations as one JSON line. An agent program
    and its tasks may be given here as Python objects instead of `--agent` and files
    (docs/agents.md, "From Python"). `pretrained`: the pretrained-model defaults the
    command line gave `config` (`train_args.parse_train_args`), said once it is built."""
    if agent is not None and not config.agent:
        name = f"{getattr(agent, '__module__', '')}:{getattr(agent, '__qualname__', 'agent')}"
        config = dataclasses.replace(config, agent=name)
    run, _ = build_run(config, service, agent=AgentInputs(agent, tasks, eval_tasks))
    if pretrained and run.main:
        print(pretrained_defaults_line(pretrained), file=sys.stderr)
    result = run.run()
    if not run.main:
        return result
    adapter = save_lora_adapter(config, run, result.out)
    if adapter is not None:
        print(f"adapter: {adapter}", file=sys.stderr)
    print(json.dumps({f"{e['when']} (step {e['step']})": round(e["eval/success"], 3)
                      for e in result.evals}))
    return result


def run_command(config: TrainConfig, pretrained: JSONObject | None = None) -> int:
    """Train `config` as the command does: an error is one line on stderr and code 2."""
    try:
        result = train(config, pretrained=pretrained)
    except (ValueError, OSError) as e:  # bad input, or a file that cannot be read or written
        print(f"prefixgym train: {error_line(e)}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"report: {result.out / 'report.md'}")
    return 0
