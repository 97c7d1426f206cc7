"""Expert episodes: recorded through the same Episode as sampled ones."""

import gymnasium as gym

from prefixgym.prompting import Conversation
from prefixgym.prompting.tokenizer import load_tokenizer
from prefixgym.rollouts.expert import play_expert


def test_expert_episode_is_the_conversation_a_rollout_of_its_replies_builds():
    tok = load_tokenizer()
    env = gym.make("prefixgym/GuessNumber-v0", max_turns=6)
    episode = play_expert(env, tok, seed=5)
    traj = episode.trajectory
    assert traj.turns and traj.is_success and traj.terminated
    # replay the same env and replies by hand through a Conversation
    agent = env.unwrapped
    conv = Conversation(tok, system=agent.system_prompt, tools=list(agent.tools))
    obs, _ = env.reset(seed=5)
    for turn in traj.turns:
        conv.add_messages(obs)
        assert conv.generation_prompt().length == turn.reply_start
        conv.add_sampled(conv.encode_reply(turn.reply_text), stop_reason="stop")
        obs, *_ = env.step(turn.reply_text)
    assert traj.tokens == conv.tokens == episode.conversation.tokens
    # replies are marked sampled (with zero logprobs), everything else is not
    sampled = [i for t in traj.turns for i in range(t.reply_start, t.reply_end)]
    assert [i for i, m in enumerate(traj.sampled_mask) if m] == sampled
    assert traj.logprobs == [0.0] * len(traj.tokens)
    assert traj.total_reward > 0
