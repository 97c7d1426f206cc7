"""What a rollout records: turns, trajectories (one episode) and groups.

A glossary, no logic beyond sums. These types know token ids and rewards; they do
not know how the tokens were sampled or how they will be trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixgym.types import Usage


@dataclass
class Turn:
    """One assistant turn: the prompt it was sampled from and what came back."""

    prompt_tokens: list[int]
    sampled_tokens: list[int]
    sampled_logprobs: list[float]
    stop_reason: str
    reply_text: str
    reward: float = 0.0
    invalid_action: bool = False
    # The request's usage. For a group's shared first turn the request served all G
    # episodes: `shared_by` says how many, and only the first episode carries it.
    usage: Usage = field(default_factory=Usage)
    shared_by: int = 1


@dataclass
class Trajectory:
    """One episode of one env, turn by turn, and the conversation's final tokens."""

    episode_id: str
    group_id: str
    seed: int
    turns: list[Turn] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    is_success: bool = False
    terminated: bool = False
    truncated: bool = False
    stop_reason: str = ""
    failed: bool = False
    error: str | None = None
    extension_ok: bool = True

    @property
    def total_reward(self) -> float:
        return sum(t.reward for t in self.turns)

    @property
    def num_sampled_tokens(self) -> int:
        return sum(len(t.sampled_tokens) for t in self.turns)

    @property
    def num_invalid_actions(self) -> int:
        return sum(t.invalid_action for t in self.turns)

    @property
    def usage(self) -> Usage:
        return Usage.total(t.usage for t in self.turns)


@dataclass
class TrajectoryGroup:
    """G episodes of one env reset with one seed: they share their first prompt."""

    group_id: str
    seed: int
    trajectories: list[Trajectory]

    @property
    def rewards_G(self) -> list[float]:
        return [t.total_reward for t in self.trajectories]

    @property
    def usage(self) -> Usage:
        return Usage.total(t.usage for t in self.trajectories)
