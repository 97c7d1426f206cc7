"""What the agent-program tests share: a sampler that answers from a script, and a
way to run one group of a program through a gateway."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prefixgym.futures import APIFuture
from prefixgym.prompting.call_tree import CallTree
from prefixgym.prompting.chat_format import ChatMLFormat
from prefixgym.rollouts.agent import AgentConfig, AgentProgram, AgentRollouts
from prefixgym.types import SampledSequence, SampleResponse, Usage

CALC = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                   "required": ["expr"]}}}]


class ScriptedSampler:
    """Answers each request with the next reply of a script (its ids and logprobs are
    what the tests compare against); records every prompt it was given."""

    def __init__(self, tokenizer, replies: Callable[[int], str], end_id: int) -> None:
        self.tokenizer, self.replies, self.end_id = tokenizer, replies, end_id
        self.prompts: list[list[int]] = []
        self.sampled: list[list[int]] = []

    def sample(self, prompt, num_samples=1, sampling_params=None, include_prompt_logprobs=False):
        tokens = prompt.tokens if hasattr(prompt, "tokens") else list(prompt)
        self.prompts.append(list(tokens))
        seqs = []
        for _ in range(num_samples):
            ids = list(self.tokenizer.encode(self.replies(len(self.sampled)),
                                             add_special_tokens=False)) + [self.end_id]
            self.sampled.append(ids)
            seqs.append(SampledSequence(tokens=ids, logprobs=[-0.01 * (i + 1) for i in range(len(ids))],
                                        stop_reason="stop"))
        usage = Usage(prefill_computed_tokens=len(tokens), sampled_tokens=sum(len(s.tokens) for s in seqs))
        return APIFuture.completed(SampleResponse(sequences=seqs, usage=usage, weights_version="v0"))

    def compute_logprobs(self, prompt):
        raise NotImplementedError




def rollouts_for(tokenizer, gateway, program, chat_format=None, timeout=60.0, weights=None):
    fmt = chat_format or ChatMLFormat(tokenizer)
    return AgentRollouts(AgentProgram(program), gateway, lambda: CallTree(tokenizer, fmt),
                         "policy", AgentConfig(timeout_s=timeout, reward_weights=weights or {}))


def run_one(rollouts, sampler, task, group_size=1, seed=0):
    [group] = asyncio.run(rollouts.run_groups(sampler, [(task, seed, "g0")], group_size))
    return group


def sampled_ids(traj) -> list[int]:
    return [t for t, m in zip(traj.tokens, traj.sampled_mask) if m]
