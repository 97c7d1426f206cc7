"""Replay a rollout trace through a simulated prefix cache and explain every miss.

1) Replay the requests in file order through `SimulatedPrefixCache`: predicted hit
   rate, and the observed one where the trace recorded usage.
2) Requests that bypass the cache (`include_prompt_logprobs`) and groups sent as
   separate requests instead of `num_samples`.
3) Across episodes: first-turn prompts that part inside the fixed prefix.
4) Within each episode: every prompt that misses more than a block of the previous
   prompt + reply, with its first diverging token and a reason.
Decoding is optional: given a `TokenDecoder` the reasons use text (re-tokenization,
volatile content); without one they use token ids alone. Knows nothing of files.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

from prefixgym.prompting.divergence import common_prefix_len, first_divergence, volatile_kind
from prefixgym.prompting.findings import Finding
from prefixgym.prompting.lint.cache_sim import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CAPACITY_TOKENS,
    SimulatedPrefixCache,
)
from prefixgym.prompting.lint.trace_file import TraceRequest
from prefixgym.types import JSONObject

# Where the first user turn starts in common chat formats: before it lies the fixed prefix.
USER_TURN = re.compile(r"<\|im_start\|>user|<\|start_header_id\|>user|<start_of_turn>user|\[INST\]|<\|user\|>")
OBSERVED_COUNTS = ("prefill_computed_tokens", "prefill_cached_tokens", "sampled_tokens")


TokenDecoder = Callable[[list[int]], str]


@dataclass
class TraceReport:
    target: str
    append_only: bool
    findings: list[Finding]
    num_requests: int
    prompt_tokens: int
    predicted_cached_tokens: int
    observed_cached_tokens: int | None
    observed_prompt_tokens: int | None
    block_size: int
    capacity_tokens: int
    decoded: bool
    episodes: int = 0
    observed_tokens: dict[str, int] | None = None
    """The sampler's own counts summed over the requests that recorded usage
    (`OBSERVED_COUNTS`): for a `prefixgym train --trace` file, report.md's."""
    extra: JSONObject = field(default_factory=dict)

    @property
    def predicted_hit_rate(self) -> float:
        return self.predicted_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def observed_hit_rate(self) -> float | None:
        if not self.observed_prompt_tokens or self.observed_cached_tokens is None:
            return None
        return self.observed_cached_tokens / self.observed_prompt_tokens

    def to_json(self) -> JSONObject:
        return {
            "target": self.target, "kind": "trace", "append_only": self.append_only,
            "requests": self.num_requests, "episodes": self.episodes,
            "prompt_tokens": self.prompt_tokens,
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "predicted_hit_rate": round(self.predicted_hit_rate, 4),
            "observed_hit_rate": None if self.observed_hit_rate is None else round(self.observed_hit_rate, 4),
            "block_size": self.block_size, "capacity_tokens": self.capacity_tokens,
            "observed_tokens": self.observed_tokens,
            "reprefilled_tokens_by_rule": reprefilled_by_rule(self.findings),
            "findings": [f.to_json() for f in self.findings], **self.extra,
        }


def reprefilled_by_rule(findings: list[Finding]) -> dict[str, int]:
    """Tokens prefilled again because of each rule's findings (their `reprefilled_tokens`)."""
    totals: dict[str, int] = defaultdict(int)
    for f in findings:
        if "reprefilled_tokens" in f.extra:
            totals[f.rule] += int(f.extra["reprefilled_tokens"])
    return dict(totals)


def _snippet(ids: list[int], at: int, decode: TokenDecoder | None) -> tuple[str, int]:
    """Text (or ids) around token `at`, and the caret offset of token `at` in it."""
    if decode is None:
        before, after = ids[max(0, at - 8) : at], ids[at : at + 12]
        head = " ".join(map(str, before)) + (" " if before else "")
        return head + " ".join(map(str, after)), len(head)
    head = decode(ids[max(0, at - 32) : at])[-40:]
    return head + decode(ids[at : at + 48])[:60], len(head)


class _Analyzer:
    def __init__(self, requests: list[TraceRequest], block_size: int, decode: TokenDecoder | None,
                 target: str) -> None:
        self.requests = requests
        self.block_size = block_size
        self.decode = decode
        self.target = target
        self.findings: list[Finding] = []
        self.append_only = True
        self.firsts: dict[str, TraceRequest] = {}
        for r in sorted(requests, key=lambda r: r.turn):
            if r.episode_id is not None:
                self.firsts.setdefault(r.episode_id, r)
        self.first_prompts = [r.prompt_tokens for r in self.firsts.values()]
        self.fixed_len = 0
        if len(self.first_prompts) >= 2:
            self.fixed_len = min(common_prefix_len(self.first_prompts[0], p) for p in self.first_prompts[1:])

    def finding(self, rule: str, message: str, location: str, expected_ids: list[int],
                actual_ids: list[int], at: int, **extra: object) -> None:
        expected, caret = _snippet(expected_ids, at, self.decode)
        actual, _ = _snippet(actual_ids, at, self.decode)
        extra.update(expected_tokens=expected_ids[at : at + 8], actual_tokens=actual_ids[at : at + 8])
        self.findings.append(Finding(rule, message, location, at, expected, actual, caret, extra))

    def classify(self, expected: list[int], actual: list[int], at: int, prev_prompt_len: int) -> tuple[str, str]:
        """(rule, reason) for `actual` leaving `expected` at token `at`."""
        in_fixed = len(self.first_prompts) >= 2 and at < self.fixed_len
        if self.decode is not None:
            left, right = self.decode(expected), self.decode(actual)
            char_at = first_divergence(left, right)
            if char_at is None or char_at >= len(self.decode(expected[: at + 1])):
                return "PG201", ("the history was re-tokenized: it decodes to the same text but to "
                                 "other token ids; append the sampled ids instead of re-encoding text")
            kind = volatile_kind(left, right, char_at)
            if kind is not None:
                return "PG203", f"volatile content ({kind}) changed in the prefix"
            user = USER_TURN.search(left)
            if user is not None:  # the first user turn bounds the fixed prefix
                in_fixed = char_at < user.start()
            if not in_fixed and at >= prev_prompt_len and "<think>" in left[char_at:] \
                    and "<think>" not in right[char_at:]:
                return "PG204", "the previous reply was edited: its reasoning block was stripped"
        if in_fixed:
            return "PG202", "the system prompt or tool definitions changed inside the fixed prefix"
        if len(actual) < len(expected) and actual == expected[: len(actual)]:
            return "PG204", "the history was truncated"
        if at >= prev_prompt_len:
            return "PG204", "the previous reply was edited before it was sent back"
        return "PG204", "the history was edited"

    def episode_breaks(self) -> None:
        """4) every prompt that leaves the previous prompt + reply of its episode."""
        episodes: dict[str, list[TraceRequest]] = defaultdict(list)
        for r in self.requests:
            if r.episode_id is not None:
                episodes[r.episode_id].append(r)
        for episode_id, reqs in episodes.items():
            reqs = sorted(reqs, key=lambda r: r.turn)
            for prev, cur in pairwise(reqs):
                candidates = [prev.prompt_tokens + c for c in prev.completion_tokens] or [prev.prompt_tokens]
                expected = max(candidates, key=lambda e: common_prefix_len(e, cur.prompt_tokens))
                at = common_prefix_len(expected, cur.prompt_tokens)
                if at == len(expected):
                    continue
                self.append_only = False
                missed = len(expected) - at
                if missed <= self.block_size:
                    continue
                rule, reason = self.classify(expected, cur.prompt_tokens, at, len(prev.prompt_tokens))
                self.finding(rule, f"{reason}; {missed} tokens of the previous prompt + reply miss the cache",
                             f"{self.target}:{cur.line}: episode {episode_id}, turn {cur.turn}",
                             expected, cur.prompt_tokens, at, episode_id=episode_id, turn=cur.turn,
                             line=cur.line, missed_tokens=missed, reprefilled_tokens=missed)

    def cross_episode(self) -> None:
        """3) first-turn prompts of different episodes that part inside the fixed prefix."""
        if self.decode is None or len(self.first_prompts) < 2:
            return
        reference_id, reference = next(iter(self.firsts)), self.first_prompts[0]
        seen: dict[str, Finding] = {}
        for r in list(self.firsts.values())[1:]:
            at = common_prefix_len(reference, r.prompt_tokens)
            if at >= min(len(reference), len(r.prompt_tokens)):
                continue
            left, right = self.decode(reference), self.decode(r.prompt_tokens)
            char_at = first_divergence(left, right) or 0
            kind = volatile_kind(left, right, char_at)
            user = USER_TURN.search(left)
            if user is not None and char_at >= user.start():
                continue  # the episodes' tasks differ after the fixed prefix: expected
            if kind is not None:
                rule, reason = "PG203", f"volatile content ({kind}) differs between episodes' prompts"
            elif user is not None:
                rule, reason = "PG202", "the system prompt or tools differ between episodes"
            else:
                continue
            lost = max(0, self.tokens_before(reference, user.start() if user else len(left)) - at)
            if rule in seen:  # one finding per rule, costing every episode it saw
                seen[rule].extra["reprefilled_tokens"] += lost
                seen[rule].extra["occurrences"] = seen[rule].extra.get("occurrences", 1) + 1
                continue
            self.finding(rule, f"{reason}, so episodes cannot share a cached prefix past token {at}",
                         f"{self.target}:{r.line}: episode {r.episode_id}, turn {r.turn} "
                         f"vs episode {reference_id}",
                         reference, r.prompt_tokens, at, episode_id=r.episode_id, line=r.line,
                         reprefilled_tokens=lost)
            seen[rule] = self.findings[-1]

    def tokens_before(self, ids: list[int], char: int) -> int:
        """How many of `ids` decode to text that ends at or before character `char`."""
        assert self.decode is not None
        lo, hi = 0, len(ids)
        while lo < hi:  # the largest k with len(decode(ids[:k])) <= char
            mid = (lo + hi + 1) // 2
            if len(self.decode(ids[:mid])) <= char:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def bypass_and_groups(self) -> None:
        """2) prompt-logprob requests, and groups split into single-sample requests."""
        bypass = [r for r in self.requests if r.include_prompt_logprobs]
        if bypass:
            tokens = sum(len(r.prompt_tokens) for r in bypass)
            self.findings.append(Finding(
                "PG205", f"{len(bypass)} request(s) ask for prompt logprobs, which prefills the whole "
                f"prompt without reading the cache ({tokens} prompt tokens recomputed); compute "
                "logprobs once at the end, or only when needed",
                f"{self.target}:{bypass[0].line}", None,
                extra={"lines": [r.line for r in bypass], "tokens": tokens,
                       "reprefilled_tokens": tokens}))
        groups: dict[tuple[str, tuple[int, ...]], list[TraceRequest]] = defaultdict(list)
        for r in self.requests:
            if r.group_id is not None and r.turn == 0 and r.num_samples == 1:
                groups[(r.group_id, tuple(r.prompt_tokens))].append(r)
        for (group_id, prompt), members in groups.items():
            if len(members) < 2:
                continue
            self.findings.append(Finding(
                "PG206", f"group {group_id}: {len(members)} requests with the same prompt and "
                f"num_samples=1; send one request with num_samples={len(members)} so that one "
                f"prefill serves the group ({(len(members) - 1) * len(prompt)} prompt tokens)",
                f"{self.target}:{members[0].line}: group {group_id}", None,
                extra={"lines": [m.line for m in members], "group_id": group_id,
                       "reprefilled_tokens": (len(members) - 1) * len(prompt)}))


def analyze_trace(requests: list[TraceRequest], block_size: int = DEFAULT_BLOCK_SIZE,
                  capacity_tokens: int = DEFAULT_CAPACITY_TOKENS,
                  decode: TokenDecoder | None = None, target: str = "<trace>") -> TraceReport:
    """Replay `requests` and report predicted/observed hit rates and every cache-unfriendly pattern."""
    # 1) replay through the simulated cache
    cache = SimulatedPrefixCache(block_size, capacity_tokens)
    prompt_tokens = predicted = 0
    obs_cached = obs_total = 0
    has_usage = False
    observed = dict.fromkeys(OBSERVED_COUNTS, 0)
    for r in requests:
        cached = 0 if r.include_prompt_logprobs else cache.match(r.prompt_tokens)
        predicted += cached
        prompt_tokens += len(r.prompt_tokens)
        cache.insert(r.prompt_tokens)
        for completion in r.completion_tokens:
            cache.insert(r.prompt_tokens + completion)
        for key in OBSERVED_COUNTS:
            observed[key] += int(r.usage.get(key, 0))
        if "prefill_cached_tokens" in r.usage:
            has_usage = True
            hit = int(r.usage["prefill_cached_tokens"])
            obs_cached += hit
            obs_total += hit + int(r.usage.get("prefill_computed_tokens", len(r.prompt_tokens) - hit))
    analyzer = _Analyzer(requests, block_size, decode, target)
    analyzer.bypass_and_groups()
    analyzer.cross_episode()
    analyzer.episode_breaks()
    findings = sorted(analyzer.findings, key=lambda f: (f.rule, f.extra.get("line", 0)))
    return TraceReport(
        target=target, append_only=analyzer.append_only, findings=findings,
        num_requests=len(requests), prompt_tokens=prompt_tokens, predicted_cached_tokens=predicted,
        observed_cached_tokens=obs_cached if has_usage else None,
        observed_prompt_tokens=obs_total if has_usage else None,
        block_size=block_size, capacity_tokens=capacity_tokens, decoded=decode is not None,
        episodes=len({r.episode_id for r in requests if r.episode_id is not None}),
        observed_tokens=observed if any(r.usage for r in requests) else None,
    )
