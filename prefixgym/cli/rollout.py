"""`prefixgym rollout`: sample episodes of an env and print them with their cache hits.

Each turn prints the prompt length, how much of it came from the prefix cache, what
the env added to the prompt before the reply (as the model saw it), and the reply;
`--trace FILE.jsonl` also writes every sampling request in the trace format that
`prefixgym lint trace` reads. With `--run DIR` (a `prefixgym train
--out`), the episodes come from that run's newest weights (the last GRPO checkpoint,
else the warm start), and the run's env, env kwargs, model, max tokens and
temperature (and chat template and its switches) are the defaults that flags given
here override. With a checkpoint directory or a .gguf file, the first lines say which
chat format the episodes use and the template's verdict at its switches, as `train`'s
do.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from prefixgym.cli.chat_template import read_template_file
from prefixgym.cli.errors import error_line
from prefixgym.cli.flags import build_config, build_parser, read_json_object
from prefixgym.rollouts.rollout import RolloutConfig, Rollouts, TraceWriter
from prefixgym.rollouts.types import TrajectoryGroup
from prefixgym.trainer.config import DEFAULT_ENV, RUN_CONFIG, default_env_kwargs
from prefixgym.types import JSONObject, Usage

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from prefixgym.local_service import LocalService
    from prefixgym.protocols import SamplingClient


@dataclass
class RolloutArgs:
    env: str = DEFAULT_ENV
    """The env: a registered id, module:id, module:Class or path/to/file.py:Class."""
    env_kwargs: JSONObject | None = None
    """Keyword arguments for the env; unset: the same defaults as `prefixgym train`."""
    model: str = "tiny"
    """A built-in preset, a local Hugging Face checkpoint directory or a .gguf file."""
    device: str = "auto"
    """Where the model runs: cpu, cuda, cuda:N, mps, or auto (a GPU when torch sees
    one, else the CPU)."""
    run: str = ""
    """A `prefixgym train --out` directory: sample from its newest weights, with its
    env and settings unless given here."""
    trace: str = ""
    """Write every sampling request to this JSONL file."""
    groups: int = 2
    """Groups to run (distinct env seeds)."""
    group_size: int = 2
    """Episodes per group, reset with one seed (their first turn is one request)."""
    seed: int = 0
    """Seed of the first group (the next groups count up)."""
    max_tokens: int = 16
    """Tokens per assistant turn at most."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""
    chat_template: str = ""
    """A chat template instead of the checkpoint's own (train's flag; with --run, the
    run's): a .jinja file, a tokenizer_config.json or a model directory."""
    chat_template_kwargs: JSONObject | None = None
    """A checkpoint directory's chat-template switches, as a JSON object (train's flag;
    with --run, the run's): conversations render with them, and the first lines give
    the template's verdict at them."""

    def __post_init__(self) -> None:
        if self.groups < 1 or self.group_size < 1:
            raise ValueError("--groups and --group-size must be at least 1")
        if self.env_kwargs is None:
            self.env_kwargs = default_env_kwargs(self.env)
        if not isinstance(self.env_kwargs, dict):
            raise ValueError(f"--env-kwargs must be a JSON object, got {self.env_kwargs!r}")


def print_group(group: TrajectoryGroup, out: TextIO | None = None,
                decode: Callable[[list[int]], str] | None = None, fixed_prefix: int = 0) -> None:
    """Each episode's turns: prompt size, cache hits, reward and reply; with `decode`,
    also what the env added to the prompt before each reply (the question, tool
    results, feedback), as the model saw it, past the `fixed_prefix` tokens."""
    out = out or sys.stdout
    for traj in group.trajectories:
        print(f"== episode {traj.episode_id} (seed {traj.seed})", file=out)
        for i, turn in enumerate(traj.turns):
            u = turn.usage
            hit = (f"cached {u.prefill_cached_tokens}/{u.prefill_tokens}"
                   if turn.usage.prefill_tokens else f"shared with {turn.shared_by - 1} others")
            print(f"  turn {i}: prompt {turn.prompt_length} tokens, {hit}; "
                  f"reward {turn.reward:+.2f}", file=out)
            if decode is not None:
                start = traj.turns[i - 1].reply_end if i else fixed_prefix
                print(f"    env: {decode(traj.tokens[start:turn.reply_start])!r}", file=out)
            print(f"    assistant: {turn.reply_text!r}", file=out)
        print(f"  -> {traj.stop_reason}; total reward {traj.total_reward:+.2f}, success "
              f"{traj.is_success}" + (f", error: {traj.error}" if traj.error else ""), file=out)


def main(argv: list[str]) -> int:
    """1) the flags over the run's settings; 2) the envs, the trace file, the model and
    its chat format, the run's weights; 3) the groups, printed; 4) the usage."""
    args = parse_args(argv)  # 1)
    from prefixgym.cli.chat_format import checkpoint_chat_format
    from prefixgym.engine.device import describe_device
    from prefixgym.envs.registration import close_all, make_agent_env
    from prefixgym.local_service import LocalService

    trace_file: TextIO | None = None
    service: LocalService | None = None
    envs: list[Any] = []
    try:  # 2)
        envs = [make_agent_env(args.env, args.env_kwargs) for _ in range(args.group_size)]
        ckpt = run_checkpoint(Path(args.run)) if args.run else None
        trace_file = open(args.trace, "w") if args.trace else None  # noqa: SIM115
        template = read_template_file(args.chat_template)
        service = LocalService(model=args.model, seed=args.seed, device=args.device)
        print(f"model: {args.model} on {describe_device(service.device)}")
        for line in checkpoint_chat_format(args.model, service.tokenizer, template,
                                           args.chat_template, args.chat_template_kwargs):
            print(line)
        sampler = sampler_of(service, ckpt)
    except (ValueError, OSError) as e:
        close_all(envs)
        if trace_file:
            trace_file.close()
        if service is not None:
            service.close()
        print(f"prefixgym rollout: {error_line(e)}", file=sys.stderr)
        return 2
    try:  # 3)
        run_groups(args, envs, sampler, service.tokenizer, trace_file)
    finally:
        close_all(envs)
        if trace_file:
            trace_file.close()
        service.close()
    print_usage(service.usage())  # 4)
    return 0


def parse_args(argv: list[str]) -> RolloutArgs:
    """The flags given, over the settings of the `--run` they name (a usage error, exit
    code 2, for a bad flag or run)."""
    parser = build_parser(RolloutArgs, prog="prefixgym rollout",
                          description="Sample episodes of an env; print transcripts and "
                          "cache hits.")
    given = vars(parser.parse_args(argv))
    try:
        from_run = run_settings(Path(given["run"])) if given.get("run") else {}
    except ValueError as e:
        parser.error(str(e))
    if "env" in given:  # another env than the run's: not the run's env kwargs either
        from_run.pop("env_kwargs", None)
    if "model" in given:  # another model: not the run's template (or switches) either
        from_run.pop("chat_template_kwargs", None)
        from_run.pop("chat_template", None)
    return build_config(RolloutArgs, parser, from_run, given)


def sampler_of(service: LocalService, ckpt: Path | None) -> SamplingClient:
    """The service's sampler: of the checkpoint's weights when there is one."""
    if ckpt is None:
        return service.create_sampling_client()
    from prefixgym.trainer.checkpoint import load_checkpoint

    training = service.create_training_client()
    load_checkpoint(ckpt, training)
    sampler = training.save_weights_and_get_sampling_client()
    print(f"weights: {ckpt}")
    return sampler


def run_groups(args: RolloutArgs, envs: list[Any], sampler: SamplingClient,
               tokenizer: PreTrainedTokenizerBase, trace_file: TextIO | None) -> None:
    """`args.groups` groups of the envs, each printed once it is done."""
    from prefixgym.envs.base import agent_of
    from prefixgym.prompting.conversation import Conversation

    rollouts = Rollouts(
        sampler, tokenizer,
        RolloutConfig(max_tokens=args.max_tokens, temperature=args.temperature),
        trace=TraceWriter(trace_file) if trace_file else None,
    )
    system, tools = agent_of(envs[0]).prompt()
    fixed = len(Conversation(tokenizer, system=system, tools=tools).tokens)
    for g in range(args.groups):
        group = asyncio.run(rollouts.run_group(envs, args.seed + g, f"g{g}"))
        print_group(group, decode=lambda ids: str(tokenizer.decode(ids)), fixed_prefix=fixed)


RUN_SETTINGS = ("env", "env_kwargs", "model", "max_tokens", "temperature", "chat_template",
                "chat_template_kwargs")


def run_checkpoint(run: Path) -> Path:
    """The newest intact checkpoint of the run in `run` (of the run its config.json
    describes, when it has one); ValueError when there is none."""
    from prefixgym.trainer.checkpoint import find_checkpoint
    from prefixgym.trainer.identity import saved_run_identity

    saved = run / RUN_CONFIG
    identity = saved_run_identity(read_json_object(saved)) if saved.exists() else None
    found = find_checkpoint(run, identity)
    if found.path is None:
        why = "; ".join(found.passed_over) or "the run saves one after its warm start"
        raise ValueError(f"no intact checkpoint under {run}/checkpoints ({why})")
    for reason in found.passed_over:
        print(f"passed over: {reason}", file=sys.stderr)
    return found.path


def run_settings(run: Path) -> JSONObject:
    """The settings of a `prefixgym train` run that a rollout of it reuses."""
    if not run.is_dir():
        raise ValueError(f"--run {run}: no such directory")
    path = run / RUN_CONFIG
    if not path.exists():
        return {}  # a run from before config.json: the flags' defaults
    saved = read_json_object(path)
    return {k: saved[k] for k in RUN_SETTINGS if k in saved}


def print_usage(usage: Usage) -> None:
    print(f"usage: prefill computed {usage.prefill_computed_tokens}, cached "
          f"{usage.prefill_cached_tokens} ({usage.cache_hit_rate:.0%}), sampled "
          f"{usage.sampled_tokens}")
