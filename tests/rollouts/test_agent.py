"""Agent programs over OpenAI's API: their calls recorded token for token through the
gateway, branches where a program rewrites its history, and the faults that fail a
rollout without stopping the others."""

from __future__ import annotations

import json
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from agent_programs import CALC, ScriptedSampler, rollouts_for, run_one, sampled_ids  # noqa: E402
from chat_templates import QWEN3_LIKE  # noqa: E402

from prefixgym.prompting.call_tree import CallMessage, CallTree, call_messages  # noqa: E402
from prefixgym.prompting.chat_format import ChatMLFormat, HFTemplateFormat  # noqa: E402
from prefixgym.prompting.tokenizer import ASSETS_DIR, load_tokenizer  # noqa: E402
from prefixgym.rollouts.agent import (  # noqa: E402
    AgentProgram,
    reward_of,
)


def tool_reply(i: int) -> str:
    if i < 2:
        return f'<tool_call>{{"name": "calc", "arguments": {{"expr": "{i + 6}*7"}}}}</tool_call>'
    return "The answer is 42."


def tool_program(edit_history: bool = False):
    def program(base_url, api_key, model, task):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "system", "content": "Use the calculator."},
                    {"role": "user", "content": task["question"]}]
        for turn in range(3):
            reply = client.chat.completions.create(model=model, messages=messages, tools=CALC)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                expr = json.loads(call.function.arguments)["expr"]
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(eval(expr))})
            if edit_history and turn == 0:  # the program trims its context: the task goes
                messages[1] = {"role": "user", "content": "(question elided)"}
        return {"correct": float("42" in (message.content or "")), "format": 0.5}
    return program


def test_a_multi_turn_tool_rollout_trains_exactly_the_sampled_ids(tokenizer, gateway):
    fmt = ChatMLFormat(tokenizer)
    sampler = ScriptedSampler(tokenizer, tool_reply, fmt.im_end)
    rollouts = rollouts_for(tokenizer, gateway, tool_program(), weights={"format": 0.0})
    group = run_one(rollouts, sampler, {"question": "What is 6*7?"})
    [traj] = group.trajectories
    assert traj.error is None and not traj.failed
    assert traj.total_reward == 1.0 and traj.reward_components == {"correct": 1.0, "format": 0.5}
    assert len(traj.turns) == 3 and traj.branches == [] and traj.branch_notes == []
    # trained ids are the sampled ids, in order, and nothing else is trained
    assert sampled_ids(traj) == [t for ids in sampler.sampled for t in ids]
    for turn, ids in zip(traj.turns, sampler.sampled):
        assert traj.tokens[turn.reply_start:turn.reply_end] == ids
        assert traj.logprobs[turn.reply_start:turn.reply_end] == [-0.01 * (i + 1) for i in range(len(ids))]
    # each prompt extends the previous prompt + its reply: the tree never re-renders history
    for prev, reply, nxt in zip(sampler.prompts, sampler.sampled, sampler.prompts[1:]):
        assert nxt[:len(prev) + len(reply)] == prev + reply
    assert traj.tokens[:len(sampler.prompts[-1])] == sampler.prompts[-1]
    assert traj.usage.sampled_tokens == sum(len(s) for s in sampler.sampled)


FORCED_OPENINGS = ['<tool_call>{"name": "calc", "arguments":', '<tool_call>{"name": "', ""]


def forced_program(base_url, api_key, model, task):
    """Turn 1 names the tool, turn 2 requires a tool, turn 3 leaves the choice to the model."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task["question"]}]
    choices = [{"type": "function", "function": {"name": "calc"}}, "required", "auto"]
    for choice in choices:
        reply = client.chat.completions.create(model=model, messages=messages, tools=CALC,
                                               tool_choice=choice)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            expr = json.loads(call.function.arguments)["expr"]
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": str(eval(expr))})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "Call the tool, please."})
    return float("42" in (message.content or ""))


@pytest.mark.parametrize("through_template", [False, True], ids=["builtin", "hf-template"])
def test_a_forced_tool_choice_keeps_one_sequence_and_trains_only_the_sampled_ids(
        tokenizer, gateway, through_template):
    if through_template:  # the same format as a tokenizer's template, rendered turn by turn
        tokenizer = load_tokenizer(ASSETS_DIR)
        fmt = HFTemplateFormat(tokenizer)
    else:
        fmt = ChatMLFormat(tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampler = ScriptedSampler(
        tokenizer, lambda i: tool_reply(i).removeprefix(FORCED_OPENINGS[min(i, 2)]), end)
    group = run_one(rollouts_for(tokenizer, gateway, forced_program, chat_format=fmt), sampler,
                    {"question": "What is 6*7?"})
    [traj] = group.trajectories
    assert traj.error is None and traj.total_reward == 1.0
    assert len(traj.turns) == 3 and traj.branches == [] and traj.branch_notes == []
    assert sampled_ids(traj) == [t for ids in sampler.sampled for t in ids]
    for turn, ids, prompt, opening in zip(traj.turns, sampler.sampled, sampler.prompts,
                                          FORCED_OPENINGS):
        forced = tokenizer.encode(opening, add_special_tokens=False)
        assert prompt[len(prompt) - len(forced):] == forced  # the opening ends the prompt
        assert turn.reply_start == len(prompt) and traj.tokens[:turn.reply_end] == prompt + ids
        assert not any(traj.sampled_mask[len(prompt) - len(forced):len(prompt)])
        assert turn.reply_text.startswith(opening)  # the reply's text reads the forced opening too
    for prev, reply, nxt in zip(sampler.prompts, sampler.sampled, sampler.prompts[1:]):
        assert nxt[:len(prev) + len(reply)] == prev + reply


def test_a_forced_reply_that_writes_no_call_is_an_invalid_action(tokenizer, gateway):
    fmt = ChatMLFormat(tokenizer)
    sampler = ScriptedSampler(tokenizer, lambda i: "The answer is 42.", fmt.im_end)
    group = run_one(rollouts_for(tokenizer, gateway, forced_program), sampler,
                    {"question": "What is 6*7?"})
    [traj] = group.trajectories
    assert traj.error is None and traj.branches == []
    assert [t.invalid_action for t in traj.turns] == [True, True, False]
    assert traj.turns[0].reply_text == FORCED_OPENINGS[0] + "The answer is 42."
    assert sampled_ids(traj) == [t for ids in sampler.sampled for t in ids]


def test_a_template_that_drops_reasoning_still_trains_the_sampled_reasoning(tokenizer, gateway):
    qwen = load_tokenizer(ASSETS_DIR)  # a copy: the shared built-in one stays as it is
    qwen.chat_template = QWEN3_LIKE
    fmt = HFTemplateFormat(qwen)
    assert fmt.template_mismatch  # rendered whole, earlier reasoning would be dropped
    end = qwen.convert_tokens_to_ids("<|im_end|>")
    replies = ["<think>six sevens</think>\nAsking again.", "<think>done</think>\nIt is 42."]
    sampler = ScriptedSampler(qwen, lambda i: replies[i], end)

    def program(base_url, api_key, model, task):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": "6*7?"}]
        for _ in range(2):
            message = client.chat.completions.create(model=model, messages=messages).choices[0].message
            assert "<think>" not in (message.content or "")  # reasoning comes apart
            messages += [{"role": "assistant", "content": message.content}, {"role": "user", "content": "sure?"}]
        return 1.0

    group = run_one(rollouts_for(qwen, gateway, program, chat_format=fmt), sampler, {})
    [traj] = group.trajectories
    assert traj.error is None and traj.branches == []
    assert sampled_ids(traj) == [t for ids in sampler.sampled for t in ids]
    assert sampler.prompts[1][:len(sampler.prompts[0]) + len(sampler.sampled[0])] == \
        sampler.prompts[0] + sampler.sampled[0]  # the think block kept, as sampled


def test_a_program_that_edits_its_history_branches_and_says_what_it_cost(tokenizer, gateway):
    fmt = ChatMLFormat(tokenizer)
    sampler = ScriptedSampler(tokenizer, tool_reply, fmt.im_end)
    group = run_one(rollouts_for(tokenizer, gateway, tool_program(edit_history=True)), sampler,
                    {"question": "What is 6*7?"})
    [traj] = group.trajectories
    assert traj.error is None
    assert len(traj.branches) == 1 and len(traj.branch_notes) == 1
    note = traj.branch_notes[0]
    assert note.startswith("call 1: PG204 message 1 (user) was edited") and "prefilled again" in note
    # the branch is the first call's sequence; every sampled reply is trained exactly once
    [branch] = traj.branches
    trained = sampled_ids(traj) + sampled_ids(branch)
    assert sorted(trained) == sorted(t for ids in sampler.sampled for t in ids)
    assert sampled_ids(branch) == sampler.sampled[0]
    # the cost is the prompt past what it shares with the earlier sequence
    shared = next(i for i, (a, b) in enumerate(zip(sampler.prompts[0], sampler.prompts[1])) if a != b)
    assert f"{len(sampler.prompts[1]) - shared} of its {len(sampler.prompts[1])} prompt tokens" in note


def test_a_groups_first_calls_share_one_prefill(tokenizer, gateway):
    """G programs posing one task send the same first prompt: in lockstep the round joins
    them into one request for G samples (one prefill): the first call's prompt is computed,
    the others' counted as cached, as the engine counts a request joining another's."""
    fmt = ChatMLFormat(tokenizer)
    requests = []

    class CountingSampler(ScriptedSampler):
        def sample(self, prompt, num_samples=1, sampling_params=None, include_prompt_logprobs=False):
            requests.append((num_samples, sampling_params.seed))
            return super().sample(prompt, num_samples, sampling_params)

    sampler = CountingSampler(tokenizer, lambda i: "The answer is 42.", fmt.im_end)
    group = run_one(rollouts_for(tokenizer, gateway, tool_program()), sampler,
                    {"question": "6*7?"}, group_size=4, seed=5)
    assert [t.episode_id for t in group.trajectories] == [f"g0/{i}" for i in range(4)]
    assert all(t.total_reward == 1.5 and not t.failed for t in group.trajectories)
    assert len(requests) == 1 and requests[0][0] == 4
    P = len(sampler.prompts[0])
    assert group.usage.prefill_computed_tokens == P
    assert group.usage.prefill_cached_tokens == 3 * P
    assert [t.usage.prefill_computed_tokens + t.usage.prefill_cached_tokens
            for t in group.trajectories] == [P] * 4
    assert [sampled_ids(t) for t in group.trajectories] == sampler.sampled


def faulty(kind: str):
    def program(base_url, api_key, model, task):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        if kind == "raises":
            raise RuntimeError("the tool server is down")
        if kind == "raises ValueError":
            raise ValueError("a bad task")
        if kind == "raises TimeoutError":
            raise TimeoutError("the tool timed out")
        if kind == "hangs":
            time.sleep(30)
        if kind == "wrong model":
            try:
                client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}])
            except openai.NotFoundError:
                return 1.0  # swallowed: the rollout still fails
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
        return {"text": "not a number"} if kind == "no number" else None
    return program


@pytest.mark.parametrize("kind, error", [
    ("raises", "the program raised RuntimeError: the tool server is down"),
    ("raises ValueError", "the program raised ValueError: a bad task"),
    ("raises TimeoutError", "the program raised TimeoutError: the tool timed out"),
    ("hangs", "the program did not return within 0.5 s"),
    ("no number", "the program's reward component 'text' is 'not a number', not a number"),
    ("none", "the program returned None, not a reward (a number, or a dict of named numbers)"),
    ("wrong model", "a call was refused: 404: model 'gpt-5' does not exist; this rollout trains 'policy'"),
])
def test_a_faulty_program_fails_its_rollout_in_one_line(tokenizer, gateway, kind, error):
    fmt = ChatMLFormat(tokenizer)
    sampler = ScriptedSampler(tokenizer, lambda i: "ok", fmt.im_end)
    start = time.monotonic()
    timeout = 0.5 if kind == "hangs" else 60.0  # only the hung program waits for it
    group = run_one(rollouts_for(tokenizer, gateway, faulty(kind), timeout=timeout), sampler, {})
    [traj] = group.trajectories
    assert traj.failed and traj.error == error
    assert time.monotonic() - start < 20  # a hung program is left behind, not waited for


def test_no_state_passes_between_rollouts(tokenizer, gateway):
    """A base URL stops answering once its rollout has returned."""
    fmt = ChatMLFormat(tokenizer)
    sampler = ScriptedSampler(tokenizer, lambda i: "ok", fmt.im_end)
    urls = []

    def program(base_url, api_key, model):
        urls.append(base_url)
        return 0.0

    run_one(rollouts_for(tokenizer, gateway, program), sampler, {})
    client = openai.OpenAI(base_url=urls[0], api_key="secret", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="no rollout"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])


def test_the_gateway_wants_its_key(tokenizer, gateway):
    fmt = ChatMLFormat(tokenizer)
    sampler = ScriptedSampler(tokenizer, lambda i: "ok", fmt.im_end)

    def program(base_url, model):
        client = openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0)
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
        return 1.0

    [traj] = run_one(rollouts_for(tokenizer, gateway, program), sampler, {}).trajectories
    assert traj.failed and "AuthenticationError" in traj.error


def test_reward_of_weighs_named_components():
    assert reward_of(2, {}) == (2.0, {"reward": 2.0})
    assert reward_of({"a": 1.0, "b": 0.5}, {"b": 2.0}) == (2.0, {"a": 1.0, "b": 0.5})
    for bad in (True, "1", None, float("nan"), {"a": "x"}):
        with pytest.raises(ValueError):
            reward_of(bad, {})


def test_a_program_must_take_the_documented_arguments():
    with pytest.raises(ValueError, match="requires \\['client'\\]"):
        AgentProgram(lambda client, task: 0)
    assert AgentProgram(lambda task, **kw: 0).args == ("base_url", "api_key", "model", "task")
    assert AgentProgram(lambda model=None: 0).args == ("model",)


def test_a_call_that_fails_keeps_the_sequence_it_would_have_continued(tokenizer):
    """A call the sampler refuses (here: past its limits) records nothing, and the
    conversation it extended is still trained."""
    fmt = ChatMLFormat(tokenizer)
    tree = CallTree(tokenizer, fmt)
    first = tree.begin(call_messages([{"role": "user", "content": "hi"}]))
    ids = list(tokenizer.encode("hello", add_special_tokens=False)) + [fmt.im_end]
    tree.add_reply(first, ids, [-0.5] * len(ids), "stop",
                   lambda text: CallMessage("assistant", text))
    tree.begin(call_messages([{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "hello"},
                              {"role": "user", "content": "again"}]))  # then sampling fails
    [seq] = tree.sequences()
    assert [t for t, m in zip(seq.tokens, seq.sampled_mask) if m] == ids
