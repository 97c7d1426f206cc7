"""Supervised warm start: cross-entropy on the env's expert episodes.

A model that starts from random weights never samples a valid reply, so GRPO has no
signal. The warm start plays the env's scripted expert through the same
`Conversation` the rollouts use, tokenizes each expert reply as if it had been
sampled (reply + end-of-turn), and trains on those tokens only. Knows envs,
conversations and the training protocol; not how sampling works.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from prefixgym.prompting import Conversation
from prefixgym.rollouts.types import Trajectory, Turn
from prefixgym.trainer.datum import trajectory_to_datums
from prefixgym.trainer.schedule import warmup_cosine_lr
from prefixgym.types import AdamParams, Datum, Usage

SFT_SEED_BASE = 2_000_000


def expert_trajectory(env: Any, tokenizer: Any, seed: int, max_turns: int = 64) -> Trajectory:
    """One episode of the env's expert, recorded as if its replies had been sampled."""
    agent = env.unwrapped
    conv = Conversation(tokenizer=tokenizer, system=agent.system_prompt, tools=list(agent.tools))
    traj = Trajectory(episode_id=f"expert/{seed}", group_id=f"expert/{seed}", seed=seed)
    obs, _ = env.reset(seed=seed)
    for _ in range(max_turns):
        for m in obs:
            if m["role"] == "tool":
                conv.add_tool_result(m.get("name", ""), m["content"])
            else:
                conv.add_user(m["content"])
        prompt = conv.generation_prompt()
        text = agent.expert_action()
        reply = conv.encode_reply(text)  # the reply's ids + end-of-turn
        conv.add_sampled(reply, stop_reason="stop")
        obs, reward, terminated, truncated, info = env.step(text)
        traj.turns.append(Turn(list(prompt.tokens), reply, [0.0] * len(reply), "stop", text,
                               float(reward)))
        if terminated or truncated:
            traj.is_success = bool(info.get("is_success", False))
            break
    traj.tokens = list(conv.tokens)
    return traj


def expert_datums(envs: Sequence[Any], tokenizer: Any, seeds: Sequence[int]) -> list[Datum]:
    datums: list[Datum] = []
    for i, seed in enumerate(seeds):
        traj = expert_trajectory(envs[i % len(envs)], tokenizer, seed)
        for d in trajectory_to_datums(traj, advantage=0.0).datums:
            inputs = {k: d.loss_fn_inputs[k] for k in ("target_tokens", "weights")}
            datums.append(Datum(model_input=d.model_input, loss_fn_inputs=inputs))
    return datums


def warm_start(
    training: Any, envs: Sequence[Any], tokenizer: Any, steps: int, episodes_per_step: int,
    lr: float, on_step: Callable[[int, dict[str, float], Usage], None] | None = None,
) -> Usage:
    """`steps` AdamW steps of cross-entropy, each on fresh expert episodes.

    The loss is a sum over tokens; dividing the weights by the step's loss tokens
    makes the learning rate independent of episode lengths. The learning rate warms
    up linearly over the first 10% of steps, then decays (cosine) to lr/10: without
    the warm-up, some random inits stall on a policy that ignores the env's hints.
    """
    total = Usage()
    for step in range(steps):
        seeds = [SFT_SEED_BASE + step * episodes_per_step + i for i in range(episodes_per_step)]
        datums = expert_datums(envs, tokenizer, seeds)
        n_loss = sum(d.num_loss_tokens for d in datums)
        for d in datums:
            d.loss_fn_inputs["weights"] = [w / n_loss for w in d.loss_fn_inputs["weights"]]
        out = training.forward_backward(datums, loss_fn="cross_entropy").result()
        opt = training.optim_step(
            AdamParams(learning_rate=warmup_cosine_lr(step, steps, lr), grad_clip_norm=1.0)
        ).result()
        total = total + out.usage
        if on_step is not None:
            on_step(step, {"sft/loss": out.metrics["loss"],
                           **{f"optim/{k}": v for k, v in opt.metrics.items()}}, out.usage)
    return total
