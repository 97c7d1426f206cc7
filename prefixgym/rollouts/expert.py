"""Episodes of an env's scripted expert, recorded as if its replies had been sampled.

The warm start trains on them, and `prefixgym lint env` checks their prompts. Each
expert reply is tokenized the way a sampled one would end (reply + end-of-turn) and
appended through the same `Episode` the sampler's rollouts use, so the tokens are
exactly the ones a rollout of the same replies would produce. Knows envs and
conversations; no sampler is involved.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from prefixgym.prompting import Conversation
from prefixgym.rollouts.episode import AgentGymEnv, Episode
from prefixgym.rollouts.types import Trajectory

MAX_EXPERT_TURNS = 64


@dataclass
class ExpertEpisode:
    trajectory: Trajectory
    conversation: Conversation


def play_expert(
    env: AgentGymEnv, tokenizer: PreTrainedTokenizerBase, seed: int,
    max_turns: int = MAX_EXPERT_TURNS,
) -> ExpertEpisode:
    """Reset `env` with `seed` and play `expert_action()` until the episode ends, with the
    bookkeeping of a sampled episode (`Episode.record`). An env that raises raises here:
    a warm start must not train on a broken episode."""
    traj = Trajectory(episode_id=f"expert/{seed}", group_id=f"expert/{seed}", seed=seed)
    ep = Episode(env, tokenizer, traj)
    obs, _ = env.reset(seed=seed)
    ep.begin(obs)
    for _ in range(max_turns):
        ep.conv.generation_prompt()  # issued, as a sampler's request would be
        text = ep.agent.expert_action()
        reply = ep.conv.encode_reply(text)  # the reply's ids + end-of-turn
        turn = ep.add_reply(reply, [0.0] * len(reply), "stop")
        if not ep.record(turn, env.step(text)):
            break
    else:
        ep.end("max_turns")
    return ExpertEpisode(traj, ep.conv)
