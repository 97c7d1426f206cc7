"""Agent programs as people write them: the `openai` SDK's `responses.create` with tools and
`previous_response_id`, and OpenAI's Agents SDK over its default Responses model and
over chat completions, run unchanged against the gateway, recorded token for token."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from agent_programs import CALC, ScriptedSampler, rollouts_for, run_one, sampled_ids  # noqa: E402

from prefixgym.prompting.chat_format import ChatMLFormat  # noqa: E402


def calc_then_answer(i: int) -> str:
    if i == 0:
        return '<tool_call>{"name": "calc", "arguments": {"expr": "6*7"}}</tool_call>'
    return "It is 42."


def check_faithful(traj, sampler) -> None:
    assert traj.error is None and not traj.failed, traj.error
    assert traj.branches == []
    assert sampled_ids(traj) == [t for ids in sampler.sampled for t in ids]
    for prev, reply, nxt in zip(sampler.prompts, sampler.sampled, sampler.prompts[1:]):
        assert nxt[:len(prev) + len(reply)] == prev + reply


def test_responses_create_with_tools_and_previous_response_id(tokenizer, gateway):
    sampler = ScriptedSampler(tokenizer, calc_then_answer, ChatMLFormat(tokenizer).im_end)
    tools = [{"type": "function", **CALC[0]["function"]}]

    def program(base_url, api_key, model, task):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        first = client.responses.create(model=model, instructions="Use the calculator.",
                                        input=task["question"], tools=tools)
        [call] = [item for item in first.output if item.type == "function_call"]
        assert call.name == "calc" and json.loads(call.arguments) == {"expr": "6*7"}
        second = client.responses.create(
            model=model, instructions="Use the calculator.", tools=tools,
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "42"}])
        assert second.usage.input_tokens_details.cached_tokens == 0  # the scripted sampler's
        return float("42" in second.output_text)

    [traj] = run_one(rollouts_for(tokenizer, gateway, program), sampler,
                     {"question": "What is 6*7?"}).trajectories
    check_faithful(traj, sampler)
    assert traj.total_reward == 1.0 and len(traj.turns) == 2


def test_chat_completions_streams_with_tools(tokenizer, gateway):
    sampler = ScriptedSampler(tokenizer, calc_then_answer, ChatMLFormat(tokenizer).im_end)

    def program(base_url, api_key, model, task):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": task}]
        stream = client.chat.completions.create(model=model, messages=messages, tools=CALC,
                                                stream=True)
        calls = [c for chunk in stream for d in chunk.choices for c in (d.delta.tool_calls or [])]
        assert [c.function.name for c in calls] == ["calc"]
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].id, "type": "function",
             "function": {"name": "calc", "arguments": calls[0].function.arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "42"}]
        reply = client.chat.completions.create(model=model, messages=messages, tools=CALC)
        return float("42" in reply.choices[0].message.content)

    [traj] = run_one(rollouts_for(tokenizer, gateway, program), sampler, "6*7?").trajectories
    check_faithful(traj, sampler)
    assert traj.total_reward == 1.0


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_the_agents_sdk_drives_a_rollout_unchanged(tokenizer, gateway, api):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    sampler = ScriptedSampler(tokenizer, calc_then_answer, ChatMLFormat(tokenizer).im_end)

    @agents.function_tool
    def calc(expr: str) -> str:
        """Evaluate an arithmetic expression."""
        return str(eval(expr))

    async def program(base_url, api_key, model, task):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        kind = (agents.OpenAIResponsesModel if api == "responses"
                else agents.OpenAIChatCompletionsModel)
        agent = agents.Agent(name="calculator", instructions="Use the calculator.",
                             tools=[calc], model=kind(model=model, openai_client=client))
        result = await agents.Runner.run(agent, task["question"])
        return float("42" in result.final_output)

    [traj] = run_one(rollouts_for(tokenizer, gateway, program), sampler,
                     {"question": "What is 6*7?"}).trajectories
    check_faithful(traj, sampler)
    assert traj.total_reward == 1.0 and len(traj.turns) == 2
