"""`prefixgym train`: build the clients of a TrainConfig (from `train_args.py`), run it.

The only place that turns a TrainConfig into services and clients: a `LocalService`
for training (and sampling, unless `--sampler-url` points rollouts and evaluation at
OpenAI-compatible servers, which then receive every update: `serving.weight_sync`),
the envs from `--env`/`--env-kwargs`, then `trainer.run.Run` with all of them.
Under torchrun (WORLD_SIZE > 1: `torchrun --nproc-per-node N -m prefixgym train ...`)
it joins the process group (NCCL where the ranks train on GPUs, one each; gloo on
CPU), wraps the training
client in `DistributedTrainingClient` (`FSDPTrainingClient` with `--fsdp`), and hands
the run its `Ranks`.
With `--backend tinker` the hosted service's clients stand behind our protocols
(`prefixgym.tinker.backend`) instead of a LocalService.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from prefixgym.cli.agent_source import AgentInputs, agent_source, check_agent
from prefixgym.cli.chat_template import missing_template_line, read_template_file
from prefixgym.cli.errors import error_line
from prefixgym.engine.device import describe_device, has_fast_bf16, resolve_device
from prefixgym.engine.sampler.options import SamplerOptions
from prefixgym.engine.trainer.options import TrainerOptions
from prefixgym.engine.trainer.training import TrainingClient as LocalTrainingClient
from prefixgym.envs.base import has_expert, replays_its_seed
from prefixgym.envs.registration import make_agent_env
from prefixgym.files import ensure_writable_dir
from prefixgym.local_service import LocalService
from prefixgym.pricing import run_prices
from prefixgym.prompting.chat_format import ChatMLFormat
from prefixgym.prompting.conversation import make_chat_format, mismatch_lines, use_chat_format
from prefixgym.prompting.lint.report import switch_line, verdict_line
from prefixgym.protocols import TrainingClient
from prefixgym.rollouts.episode import AgentGymEnv
from prefixgym.rollouts.types import TrajectoryGroup
from prefixgym.serving.config import API_KEY_VARIABLE
from prefixgym.trainer.agent_steps import AgentSource
from prefixgym.trainer.clients import Clients, Ranks, RunResult
from prefixgym.trainer.config import TrainConfig, is_pretrained_checkpoint
from prefixgym.trainer.model_defaults import pretrained_defaults_line
from prefixgym.trainer.run import Run
from prefixgym.types import JSONObject, Usage

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


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
    an agent program and its tasks given as Python objects (`train`'s)."""
    agent = agent or AgentInputs()

    def make(overrides: JSONObject | None = None) -> AgentGymEnv:
        return make_agent_env(config.env, {**(config.env_kwargs or {}), **(overrides or {})})

    if config.agent:
        check_agent(config, agent)
    else:
        check_env(config, make)
    ensure_writable_dir(Path(config.out))
    template = read_template_file(config.chat_template)  # a bad file fails before the load
    pricing = run_prices(config.model, config.price_model, config.prices)
    if config.trace:  # a trace that cannot be written fails before the model loads
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
    if config.backend == "tinker":
        tinker = tinker_clients(config, tinker_service)
        return Run(config, tinker, make, pricing, with_agent(config, tinker, agent)), None
    service = service or LocalService(
        model=config.model, seed=config.seed, num_threads=config.num_threads or None,
        device=run_device(config.device),
        sampler=SamplerOptions(deterministic=config.deterministic),
    )
    if is_pretrained_checkpoint(config.model):
        if template is not None:
            service.tokenizer.chat_template = template
        try:
            check_chat_format(config, service)
        except ValueError:
            if not service.tokenizer.chat_template:
                raise ValueError(missing_template_line(config.model)) from None
            raise
    elif config.chat_template_kwargs or config.chat_template:
        raise ValueError("--chat-template and --chat-template-kwargs apply to a checkpoint's "
                         f"chat template; --model {config.model} uses the built-in format")
    ranks = torchrun_ranks(service)
    options = trainer_options(config, service.device)
    training: TrainingClient
    if config.lora_rank:
        targets = {t.strip() for t in config.lora_targets.split(",")}
        training = service.create_lora_training_client(
            rank=config.lora_rank, alpha=config.lora_alpha, train_attn="attn" in targets,
            train_mlp="mlp" in targets, train_unembed="unembed" in targets, seed=config.seed,
            options=options)
    else:
        training = service.create_training_client(options)
    if ranks.world > 1 and config.fsdp:
        from prefixgym.engine.trainer.fsdp import FSDPTrainingClient

        sharded = FSDPTrainingClient(training)  # type: ignore[arg-type]
        # the ranks waiting for rank 0's checkpoint help it gather the optimizer's state
        ranks = dataclasses.replace(ranks, barrier=sharded.barrier)
        training = sharded
    elif ranks.world > 1:
        from prefixgym.engine.trainer.distributed import DistributedTrainingClient

        training = DistributedTrainingClient(training)  # type: ignore[arg-type]
    elif config.fsdp:
        print("--fsdp: one process, nothing to shard (run under torchrun with 2 or more "
              "ranks to shard)", file=sys.stderr)
    clients = Clients(training, service.create_sampling_client(), service.tokenizer,
                      service.usage, ranks=ranks, seconds=service.seconds)
    if config.sampler_url:  # rollouts and evaluation on remote servers (docs/scaling.md)
        clients = remote_clients(config, service, training, ranks)
    # the training worker runs on this thread's count (engine/trainer/training.py)
    clients.numerics = {"compute_dtype": str(options.compute_dtype).removeprefix("torch."),
                        "threads": torch.get_num_threads(),
                        "device": describe_device(service.device)}
    return Run(config, clients, make, pricing, with_agent(config, clients, agent)), service


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


def check_chat_format(config: TrainConfig, service: LocalService) -> None:
    """Say which chat format a checkpoint's runs use, and make it the tokenizer's, with
    `--chat-template-kwargs`; ValueError for a template that cannot be used even turn
    by turn (docs/models.md, "Chat templates")."""
    for line in use_model_chat_format(config.model, service.tokenizer,
                                      config.chat_template_kwargs):
        print(line, file=sys.stderr)


def use_model_chat_format(model: str, tokenizer: PreTrainedTokenizerBase,
                          kwargs: JSONObject | None) -> list[str]:
    """Make the checkpoint's chat format, with the template switches `kwargs`, what every
    Conversation of `tokenizer` uses; the run's first lines about it: which format, the
    template's verdict at those switches and each other switch value that would break
    the prefix (the lines `lint template --template-kwargs` prints), and what a template
    rewriting earlier replies would have rendered otherwise. ValueError for a template
    that cannot be used even turn by turn. `train` and `rollout` both call this."""
    kwargs = kwargs or {}
    try:
        fmt = make_chat_format(tokenizer, template_kwargs=kwargs)
    except ValueError as e:  # TemplateNotAppendOnlyError, or no template at all
        raise ValueError(f"--model {model}: its chat template cannot be used: {e}") from None
    use_chat_format(tokenizer, fmt)
    mismatch = mismatch_lines(fmt)
    kind = ("the built-in ChatML format" if isinstance(fmt, ChatMLFormat)
            else "its tokenizer's chat template, token by token" if mismatch
            else "its tokenizer's chat template")
    switches = f" with {json.dumps(kwargs, sort_keys=True)}" if kwargs else ""
    lines = [f"--model {model}: conversations use {kind}{switches}"]
    report = getattr(fmt, "template_report", None)
    if report is not None:
        lines.append(f"--model {model}: chat template: {verdict_line(report)}")
        lines += [f"--model {model}: chat template: {switch_line(f)}" for f in report.switches]
    lines += [f"--model {model}: warning: {line}" for line in mismatch]
    return lines


def save_lora_adapter(config: TrainConfig, run: Run, out: Path) -> str | None:
    """With a local LoRA run, write its adapter to OUT/adapter (PEFT format); its path.
    (With `--backend tinker` the adapter stays on the service, in its checkpoints.)"""
    if not config.lora_rank or config.backend != "local":
        return None
    return unwrap(run.clients.training).save_weights_for_sampler(out / "adapter").result()


def unwrap(training: object) -> LocalTrainingClient[Any]:
    """The engine's training client inside the remote-sync and DDP wrappers."""
    while not isinstance(training, LocalTrainingClient):
        training = getattr(training, "training", None) or training.client  # type: ignore[attr-defined]
    return training


def sync_mode(config: TrainConfig) -> Literal["full", "lora"]:
    """How updates reach remote samplers: LoRA adapters for a run with `--lora-rank`,
    else full weights."""
    return "lora" if config.lora_rank else "full"


def weights_writer(mode: str, training: TrainingClient) -> Callable[[Path], object]:
    """What writes one published version: the PEFT adapter (LoRA: the training client's
    `save_weights_for_sampler`, issue 15) or the full model as an HF checkpoint."""
    if mode == "lora":
        inner = unwrap(training)
        return lambda path: inner.save_weights_for_sampler(path).result()
    from prefixgym.engine.model.hf_export import save_hf_checkpoint

    model = training.model  # type: ignore[attr-defined]
    return lambda path: save_hf_checkpoint(model, path)


def remote_clients(config: TrainConfig, service: LocalService, training: TrainingClient,
                   ranks: Ranks) -> Clients:
    """Samplers on `--sampler-url` servers that receive every published update; the
    starting weights are pushed now, so a server that cannot read them fails here."""
    from prefixgym.serving.openai_client import OpenAISamplingClient
    from prefixgym.serving.pool import SamplerPool
    from prefixgym.serving.weight_sync import KEEP_VERSIONS, RemoteWeightSync

    api_key = os.environ.get(API_KEY_VARIABLE) or "EMPTY"
    pool = SamplerPool([OpenAISamplingClient(url, tokenizer=service.tokenizer,
                                             ledger=service.ledger, api_key=api_key)
                        for url in config.sampler_url])
    mode = sync_mode(config)
    sync = RemoteWeightSync(
        training, pool, Path(config.out) / "sampler_weights",
        write_weights=weights_writer(mode, training), token=shared_token(ranks), mode=mode,
        is_main=ranks.is_main, barrier=ranks.barrier,
        keep_versions=max(KEEP_VERSIONS, config.staleness + 1))  # newest + the K behind it
    first = sync.save_weights_and_get_sampling_client()
    return Clients(sync, first, service.tokenizer, service.usage,
                   sampler_metrics=pool.metrics, ranks=ranks, seconds=service.seconds)


def run_device(device: str) -> torch.device:
    """`--device` for this process: under torchrun, a GPU named without an index is the
    rank's own (LOCAL_RANK)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return resolve_device(device)
    from prefixgym.engine.trainer.distributed import rank_device

    return rank_device(resolve_device(device))


def torchrun_ranks(service: LocalService) -> Ranks:
    """This process's rank under torchrun (WORLD_SIZE > 1), else the only process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Ranks()
    import torch.distributed as dist

    from prefixgym.engine.trainer.distributed import backend_for, init_distributed

    rank, world = init_distributed(backend_for(service.device))

    def gather(groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        everyone: list[Any] = [None] * world  # all_gather_object fills in unpickled lists
        dist.all_gather_object(everyone, groups)
        for other, theirs in enumerate(everyone):
            if other != rank:  # this rank's ledger counts the whole job, as for training
                service.ledger.add(Usage.total(g.usage for g in theirs))
        return sorted((g for theirs in everyone for g in theirs), key=lambda g: g.seed)

    return Ranks(rank, world, gather, dist.barrier)


def shared_token(ranks: Ranks) -> str:
    """A label prefix unique to this run, the same on every rank."""
    token = [secrets.token_hex(4)]
    if ranks.world > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(token, src=0)
    return token[0]


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
