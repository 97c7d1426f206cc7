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


def test_without_tool_schemas_the_system_turn_names_the_tools_and_the_episode_is_the_same():
    tok = load_tokenizer()
    full, compact = (play_expert(gym.make("prefixgym/Arithmetic-v0", num_operands=2,
                                          tool_schemas=schemas), tok, seed=3)
                     for schemas in (True, False))
    first = full.trajectory.turns[0].reply_start
    short = compact.trajectory.turns[0].reply_start
    prompt = tok.decode(compact.trajectory.tokens[:short])
    assert "Tools: calculator(expression)." in prompt and "<tools>" not in prompt
    assert "<tools>" in tok.decode(full.trajectory.tokens[:first])
    assert short < first - 150  # the schema is most of the default prompt
    # from the user turn on, the same tokens and the same (won) episode
    user = tok.convert_tokens_to_ids("<|im_start|>")
    tail = [t.trajectory.tokens[t.trajectory.tokens.index(user, 1):] for t in (full, compact)]
    assert tail[0] == tail[1]
    assert full.trajectory.is_success and compact.trajectory.is_success
    assert [t.reply_text for t in full.trajectory.turns] == \
        [t.reply_text for t in compact.trajectory.turns]


def test_an_expert_reply_the_env_refuses_is_recorded_as_invalid():
    """The expert path records what a sampled episode records (Episode.record): the
    reward, the invalid reply, and how the episode ended."""
    tok = load_tokenizer()
    env = gym.make("prefixgym/GuessNumber-v0", max_turns=3)
    agent = env.unwrapped
    replies = iter(["not a number", "also not", "still not"])
    agent.expert_action = lambda: next(replies)  # an expert that never answers validly
    traj = play_expert(env, tok, seed=1).trajectory
    assert [t.invalid_action for t in traj.turns] == [True, True, True]
    assert all(t.reward < 0 for t in traj.turns) and not traj.is_success
    assert traj.truncated and traj.stop_reason
