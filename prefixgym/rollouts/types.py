"""What a rollout records: turns, trajectories (one episode) and groups.

A glossary, no logic beyond sums. A `Trajectory` is the one record of an episode:
its conversation's tokens with, aligned to them, which tokens were sampled and the
sampler's logprob of each, built once when the episode ends. A `Turn` says where
its reply sits in those tokens and what the env answered. These types know token ids
and rewards; they do not know how the tokens were sampled or how they will be
trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixgym.types import Usage


@dataclass
class Turn:
    """One assistant turn. Its prompt is the episode's `tokens[:reply_start]`; its reply,
    exactly as sampled, is `tokens[reply_start:reply_end]`."""

    reply_start: int
    reply_end: int
    stop_reason: str
    reply_text: str = ""
    reward: float = 0.0
    invalid_action: bool = False
    # The request's usage. For a group's shared first turn the request served all G
    # episodes: `shared_by` says how many, and only the first episode carries it.
    usage: Usage = field(default_factory=Usage)
    shared_by: int = 1
    weights_version: str | None = None
    """The label of the weights that sampled the reply, where the sampler says."""

    @property
    def prompt_length(self) -> int:
        return self.reply_start

    @property
    def num_sampled_tokens(self) -> int:
        return self.reply_end - self.reply_start


@dataclass
class Trajectory:
    """One episode of one env: its turns, and three aligned arrays of equal length.

    `tokens` are the conversation's tokens when the episode ended; `sampled_mask[i]`
    says whether token i came from the sampler (the replies); `logprobs[i]` is the
    sampler's logprob of a sampled token and 0.0 elsewhere."""

    episode_id: str
    group_id: str
    seed: int
    turns: list[Turn] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    sampled_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    is_success: bool = False
    terminated: bool = False
    truncated: bool = False
    stop_reason: str = ""
    failed: bool = False
    error: str | None = None
    extension_ok: bool = True
    env_s: float = 0.0
    """Seconds the env spent in its reset and steps (its own work, or its server's); for
    an agent program, the seconds it ran."""
    branches: list[Trajectory] = field(default_factory=list)
    """An agent program's other sequences: where it rewrote its history, the calls after
    that began a new sequence (`prompting.call_tree`). Trained with this trajectory's
    advantage; their usage is part of this trajectory's."""
    branch_notes: list[str] = field(default_factory=list)
    """One line per branch: the call, why it continued no earlier reply, what it cost."""
    branch_reprefilled_tokens: int = 0
    """Prompt tokens its branches prefilled again (past what they shared with earlier
    sequences), summed."""
    reward_components: dict[str, float] = field(default_factory=dict)
    """An agent program's named reward parts, as it returned them."""

    @property
    def total_reward(self) -> float:
        return sum(t.reward for t in self.turns)

    @property
    def num_sampled_tokens(self) -> int:
        return sum(t.num_sampled_tokens for t in self.turns)

    @property
    def num_invalid_actions(self) -> int:
        return sum(t.invalid_action for t in self.turns)

    @property
    def usage(self) -> Usage:
        return Usage.total([*(t.usage for t in self.turns), *(b.usage for b in self.branches)])

    @property
    def trained_length(self) -> int:
        """Tokens up to the end of the last reply: what a training datum covers."""
        return self.turns[-1].reply_end if self.turns else 0


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
