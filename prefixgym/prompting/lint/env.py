"""Lint an env's conversations: run its expert policy and check the prompts it produces.

1) For each seed, reset the env and build its `Conversation` (system prompt + tools).
2) Each turn: issue the generation prompt (recorded as a trace request), render the
   expert's reply to tokens as if sampled, append it, step the env, append the
   env's messages.
3) Check: the fixed prefix is identical across seeds (PG301), every conversation
   is append-only (PG302), and the trace checks (PG2xx) on the recorded requests.
Knows nothing of samplers or models: the "sampled" tokens are the expert's reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixgym.prompting.lint.divergence import common_prefix_len
from prefixgym.prompting.lint.findings import Finding, LintInputError
from prefixgym.prompting.lint.trace import TraceReport, analyze_trace
from prefixgym.prompting.lint.trace_file import TraceRequest

MAX_TURNS = 64


@dataclass
class EnvReport:
    target: str
    append_only: bool
    findings: list[Finding]
    episodes: int
    trace: TraceReport

    def to_json(self) -> dict[str, Any]:
        trace = self.trace.to_json()
        return {
            "target": self.target, "kind": "env", "append_only": self.append_only,
            "episodes": self.episodes, "requests": trace["requests"],
            "predicted_hit_rate": trace["predicted_hit_rate"],
            "findings": [f.to_json() for f in self.findings],
        }


def _make_env(env_id: str) -> Any:
    try:
        import gymnasium as gym

        import prefixgym.envs  # noqa: F401  (registers the built-in ids)
        from prefixgym.prompting.conversation import Conversation  # noqa: F401
    except ImportError as exc:
        raise LintInputError(f"lint env is not available yet: {exc}") from None
    try:
        return gym.make(env_id)
    except Exception as exc:  # noqa: BLE001  (gymnasium raises several types for unknown ids)
        raise LintInputError(f"cannot make env {env_id!r}: {exc}") from None


def _add_observation(conv: Any, observation: Any) -> None:
    for message in observation:
        if message["role"] == "tool":
            conv.add_tool_result(message["name"] or "tool", message["content"])
        else:
            conv.add_user(message["content"])


def lint_env(env_id: str, episodes: int = 3, block_size: int = 16, tokenizer: Any = None,
             seeds: list[int] | None = None) -> EnvReport:
    """Run `episodes` expert episodes of `env_id` (seeds 0..n-1) and lint their prompts."""
    from prefixgym.prompting.conversation import Conversation

    if episodes < 1:
        raise LintInputError(f"--episodes must be at least 1, got {episodes}")
    env = _make_env(env_id)
    if tokenizer is None:
        from prefixgym.engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer("builtin")
    requests: list[TraceRequest] = []
    findings: list[Finding] = []
    prefixes: list[tuple[int, list[int]]] = []
    append_only = True
    for seed in seeds if seeds is not None else range(episodes):
        # 1) reset and build the conversation
        observation, _ = env.reset(seed=seed)
        agent = env.unwrapped
        conv = Conversation(tokenizer, system=agent.system_prompt or None, tools=agent.tools)
        prefixes.append((seed, conv.fixed_prefix))
        _add_observation(conv, observation)
        # 2) expert turns
        for turn in range(MAX_TURNS):
            prompt = conv.generation_prompt().to_ints()
            reply = agent.expert_action()
            sampled = conv.format.render_reply(reply, history=conv.messages, tools=conv.tools)
            requests.append(TraceRequest(len(requests) + 1, f"seed{seed}", f"seed{seed}", turn,
                                         prompt, [sampled], 1, False))
            conv.add_sampled(sampled, stop_reason="stop")
            observation, _, terminated, truncated, _ = env.step(reply)
            if terminated or truncated:
                break
            _add_observation(conv, observation)
        conv.generation_prompt()  # checks the last reply was extended
        if not conv.extension_ok:
            append_only = False
            findings.append(Finding(
                "PG302", "a generation prompt does not extend the previous prompt + reply",
                f"{env_id}: seed {seed}", conv.first_divergence))
    # 3) checks
    reference_seed, reference = prefixes[0]
    for seed, prefix in prefixes[1:]:
        if prefix != reference:
            at = common_prefix_len(reference, prefix)
            findings.append(Finding(
                "PG301", f"the fixed prefix (system prompt + tools) of seed {seed} differs from "
                f"seed {reference_seed}'s at token {at}: episodes cannot share its cache entry",
                f"{env_id}: seed {seed}", at, extra={"seed": seed}))
            break

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    trace = analyze_trace(requests, block_size=block_size, decode=decode, target=env_id)
    env.close()
    return EnvReport(env_id, append_only and trace.append_only, findings + trace.findings,
                     len(prefixes), trace)
