"""Lint an env's conversations: the prompts of its expert episodes, checked.

The episodes are played elsewhere (`prefixgym lint env` plays the env's scripted
expert through `rollouts.expert`, the same loop the warm start trains on) and arrive
here as finished `Conversation`s, one per seed:
1) each conversation's replies become trace requests: the prompt is the tokens
   before the reply, the completion the reply's tokens;
2) check: the fixed prefix is identical across episodes (PG301), every conversation
   is append-only (PG302), and the trace checks (PG2xx) on the requests.
Knows conversations and tokens; nothing of envs, samplers or models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefixgym.prompting.conversation import Conversation
from prefixgym.prompting.divergence import common_prefix_len
from prefixgym.prompting.findings import Finding, LintInputError
from prefixgym.prompting.lint.cache_sim import DEFAULT_BLOCK_SIZE
from prefixgym.prompting.lint.trace import TraceReport, analyze_trace
from prefixgym.prompting.lint.trace_file import TraceRequest
from prefixgym.types import JSONObject


@dataclass
class EnvReport:
    target: str
    append_only: bool
    findings: list[Finding]
    episodes: int
    trace: TraceReport

    def to_json(self) -> JSONObject:
        trace = self.trace.to_json()
        return {
            "target": self.target, "kind": "env", "append_only": self.append_only,
            "episodes": self.episodes, "requests": trace["requests"],
            "predicted_hit_rate": trace["predicted_hit_rate"],
            "findings": [f.to_json() for f in self.findings],
        }


def conversation_requests(label: str, conv: Conversation, first_line: int) -> list[TraceRequest]:
    """1) One trace request per assistant reply of `conv`, numbered from `first_line`."""
    tokens = conv.tokens
    replies = [seg for seg in conv.segments if seg.kind == "reply"]
    return [TraceRequest(first_line + i, label, label, i, tokens[: seg.start],
                         [tokens[seg.start : seg.end]], 1, False)
            for i, seg in enumerate(replies)]


def lint_conversations(
    target: str, conversations: Sequence[tuple[str, Conversation]], block_size: int = DEFAULT_BLOCK_SIZE,
) -> EnvReport:
    """Lint finished conversations, each with a label (e.g. "seed 3")."""
    if not conversations:
        raise LintInputError("no conversations to lint: run at least one episode")
    tokenizer = conversations[0][1].tokenizer
    requests: list[TraceRequest] = []
    findings: list[Finding] = []
    append_only = True
    for label, conv in conversations:
        requests += conversation_requests(label, conv, len(requests) + 1)
        conv.generation_prompt()  # checks that the last reply was extended too
        if not conv.extension_ok:
            append_only = False
            findings.append(Finding(
                "PG302", "a generation prompt does not extend the previous prompt + reply",
                f"{target}: {label}", conv.first_divergence))
    # 2) checks
    reference_label, reference = conversations[0][0], conversations[0][1].fixed_prefix
    for label, conv in conversations[1:]:
        prefix = conv.fixed_prefix
        if prefix != reference:
            at = common_prefix_len(reference, prefix)
            findings.append(Finding(
                "PG301", f"the fixed prefix (system prompt + tools) of {label} differs from "
                f"{reference_label}'s at token {at}: episodes cannot share its cache entry",
                f"{target}: {label}", at, extra={"episode": label}))
            break

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=False,
                                    clean_up_tokenization_spaces=False))

    trace = analyze_trace(requests, block_size=block_size, decode=decode, target=target)
    return EnvReport(target, append_only and trace.append_only, findings + trace.findings,
                     len(conversations), trace)
