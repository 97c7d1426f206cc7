"""A rollout's chat calls as agent frameworks send them: the bodies LangGraph, smolagents,
pydantic-ai and LiteLLM sent (captured from their runs against `prefixgym proxy`, as
they are) are answered in shapes the openai SDK parses and continue one sequence; null
fields are fields not sent; `tool_choice: "none"` takes no calls, "required" and a named
function are forced (the call's opening ends the prompt); what the engine cannot do is a
400 that names the field. A scripted sampler answers: first a call, then text."""

from __future__ import annotations

import copy
import json

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from agent_programs import ScriptedSampler  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

from prefixgym.prompting.call_tree import CallTree  # noqa: E402
from prefixgym.prompting.chat_format import ChatMLFormat  # noqa: E402
from prefixgym.prompting.tokenizer import load_tokenizer  # noqa: E402
from prefixgym.prompting.tool_syntax import (  # noqa: E402
    HermesSyntax,
    Olmo3Syntax,
    ToolCallSyntax,
)
from prefixgym.serving.agent_gateway import AgentGateway  # noqa: E402

MODEL = "policy"
CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "6*7"}}</tool_call>'
ANSWER = "It is 42."
TEXT_ANSWER = {"content": ANSWER, "calls": []}
REQUIRED_OPENING = '<tool_call>{"name": "'
PARAMETERS = {"type": "object", "properties": {"expr": {"type": "string"}},
              "required": ["expr"]}
CALC = {"type": "function", "function": {"name": "calc",
                                         "description": "Evaluate an arithmetic expression.",
                                         "parameters": PARAMETERS}}


def echoed_call(arguments: str, **fields: object) -> dict:
    """The assistant message a framework sends back for the first reply's call."""
    return {"role": "assistant", **fields, "tool_calls": [
        {"id": "call_0_0_0", "type": "function",
         "function": {"name": "calc", "arguments": arguments}}]}


def conversation(system: object, user: object) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


LANGGRAPH = {  # langchain-openai 1.8.1, langgraph 1.2.24: create_react_agent
    "model": MODEL, "stream": False, "max_completion_tokens": 40, "temperature": 0.7,
    "messages": conversation("You are a calculator agent.", "What is 6*7?"), "tools": [CALC]}
LANGGRAPH_ECHO = [echoed_call('{"expr": "6*7"}', content=None),
                  {"content": "42", "role": "tool", "tool_call_id": "call_0_0_0"}]
PYDANTIC_AI = {  # pydantic-ai-slim 2.78.0: Agent over OpenAIChatModel, run_stream
    "model": MODEL, "stream": True, "max_completion_tokens": 60,
    "stream_options": {"include_usage": True}, "temperature": 0.7, "tool_choice": "auto",
    "messages": conversation("Use the calc tool.", "What is 6*7?"),
    "tools": [{"type": "function", "function": {
        **CALC["function"], "parameters": {**PARAMETERS, "additionalProperties": False},
        "strict": True}}]}
PYDANTIC_AI_ECHO = [echoed_call('{"expr":"6*7"}', content=None),
                    {"role": "tool", "tool_call_id": "call_0_0_0", "content": "42"}]
LITELLM = {  # litellm 1.110.2: completion(model="hosted_vllm/...", stream=True)
    "model": MODEL, "temperature": 0.5, "stream": True, "max_tokens": 60, "seed": 1,
    "tool_choice": "auto", "parallel_tool_calls": True, "tools": [CALC],
    "messages": conversation("Use calc.", "What is 6*7?")}
LITELLM_ECHO = [echoed_call('{"expr": "6*7"}', content=""),  # no content when not streamed
                {"role": "tool", "tool_call_id": "call_0_0_0", "name": "calc", "content": "42"}]
SMOLAGENTS = {  # smolagents 1.26.0: ToolCallingAgent over OpenAIServerModel, streamed
    "model": MODEL, "stream": True, "max_tokens": 60, "stop": ["Observation:", "Calling tools:"],
    "stream_options": {"include_usage": True}, "tool_choice": "required",
    "messages": conversation([{"type": "text", "text": "You are an expert assistant."}],
                             [{"type": "text", "text": "New task:\nWhat is 6*7?"}]),
    "tools": [CALC, {"type": "function", "function": {
        "name": "final_answer", "description": "Provides a final answer to the given problem.",
        "parameters": {"type": "object", "required": ["answer"], "properties": {
            "answer": {"type": "string", "description": "The final answer to the problem"}}}}}]}
SMOLAGENTS_ECHO = [  # its memory writes the call back as text, the result as a user turn
    {"role": "assistant", "content": [{"type": "text", "text": (
        "Calling tools:\n[{'id': 'call_0_0_0', 'type': 'function', 'function': "
        "{'name': 'calc', 'arguments': {'expr': '6*7'}}}]")}]},
    {"role": "user", "content": [{"type": "text", "text": "Observation:\n42"}]}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def gateway():
    gw = AgentGateway(MODEL)
    yield gw
    gw.stop()


class Rollout:
    """One open rollout of `gateway`, answered by a script; what its sampler was asked."""

    count = 0

    def __init__(self, tokenizer, gateway, replies=(CALL, ANSWER)) -> None:
        fmt = ChatMLFormat(tokenizer)
        self.tree = CallTree(tokenizer, fmt)
        self.sampler = ScriptedSampler(tokenizer, lambda i: replies[min(i, len(replies) - 1)],
                                       fmt.im_end)
        self.params: list = []
        sample = self.sampler.sample

        def recording(prompt, num_samples=1, sampling_params=None, **kw):
            self.params.append(sampling_params)
            return sample(prompt, num_samples, sampling_params, **kw)

        self.sampler.sample = recording
        Rollout.count += 1
        self.key, self.gateway = f"r{Rollout.count}", gateway
        self.url = gateway.open(self.key, self.tree, self.sampler, seed=0)

    def post(self, route: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.url}/{route}", json=body, timeout=60)

    def chat(self, body: dict) -> dict:
        """The answer to a chat body, as the openai SDK reads it (a stream, assembled)."""
        reply = self.post("chat/completions", body)
        assert reply.status_code == 200, reply.text
        if not body.get("stream"):
            message = ChatCompletion.model_validate(reply.json()).choices[0].message
            calls = [(c.function.name, json.loads(c.function.arguments))
                     for c in message.tool_calls or []]
            return {"content": message.content, "calls": calls}
        lines = [line.removeprefix("data: ") for line in reply.text.splitlines() if line]
        assert lines[-1] == "[DONE]"
        chunks = [ChatCompletionChunk.model_validate_json(line) for line in lines[:-1]]
        deltas = [choice.delta for chunk in chunks for choice in chunk.choices]
        if (body.get("stream_options") or {}).get("include_usage"):
            assert chunks[-1].usage is not None and chunks[-1].choices == []
        return {"content": "".join(d.content or "" for d in deltas),
                "calls": [(c.function.name, json.loads(c.function.arguments))
                          for d in deltas for c in d.tool_calls or []]}

    def close(self) -> list[str]:
        return self.gateway.close(self.key)


SMOLAGENTS_REPLIES = (  # its tool_choice "required": each prompt ends with REQUIRED_OPENING
    CALL.removeprefix(REQUIRED_OPENING),
    'final_answer", "arguments": {"answer": "42"}}</tool_call>')


@pytest.mark.parametrize(("first", "echo", "replies", "second_answer", "branch_rules"), [
    (LANGGRAPH, LANGGRAPH_ECHO, (CALL, ANSWER), TEXT_ANSWER, []),
    (PYDANTIC_AI, PYDANTIC_AI_ECHO, (CALL, ANSWER), TEXT_ANSWER, []),
    (LITELLM, LITELLM_ECHO, (CALL, ANSWER), TEXT_ANSWER, []),
    (SMOLAGENTS, SMOLAGENTS_ECHO, SMOLAGENTS_REPLIES,  # it rewrites the call it got as text
     {"content": "", "calls": [("final_answer", {"answer": "42"})]}, ["PG204"]),
], ids=["langgraph", "pydantic-ai", "litellm", "smolagents"])
def test_what_frameworks_send_is_answered_and_continues_one_sequence(
        tokenizer, gateway, first, echo, replies, second_answer, branch_rules):
    rollout = Rollout(tokenizer, gateway, replies)
    assert rollout.chat(first)["calls"] == [("calc", {"expr": "6*7"})]
    second = copy.deepcopy(first)
    second["messages"] += echo
    assert rollout.chat(second) == second_answer
    assert rollout.close() == []
    assert [b.rule for b in rollout.tree.branches] == branch_rules
    [prompt, later] = rollout.sampler.prompts
    if not branch_rules:  # the second prompt extends the first prompt and its reply
        assert later[:len(prompt) + len(rollout.sampler.sampled[0])] == \
            prompt + rollout.sampler.sampled[0]


def test_a_field_sent_as_null_is_a_field_not_sent(tokenizer, gateway):
    rollout = Rollout(tokenizer, gateway, replies=(ANSWER,))
    nulls = dict.fromkeys(("temperature", "top_p", "n", "stop", "seed", "max_tokens",
                           "max_completion_tokens", "logprobs", "top_logprobs", "stream",
                           "stream_options", "tools", "tool_choice", "parallel_tool_calls",
                           "frequency_penalty", "presence_penalty", "logit_bias",
                           "response_format"))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **nulls}
    assert rollout.chat(body) == {"content": ANSWER, "calls": []}
    [params] = rollout.params  # the run's defaults, as for a call that names none
    defaults = gateway.defaults
    assert (params.temperature, params.top_p, params.max_tokens) == \
        (defaults.temperature, defaults.top_p, defaults.max_tokens)
    reply = rollout.post("responses", {"model": MODEL, "input": "hi", "stream": None,
                                       "store": None, "temperature": None, "tools": None})
    assert reply.status_code == 200, reply.text
    assert reply.json()["output"][0]["content"][0]["text"] == ANSWER
    assert rollout.close() == []


def test_tool_choice_none_leaves_a_written_call_as_text(tokenizer, gateway):
    rollout = Rollout(tokenizer, gateway)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "6*7?"}],
            "tools": [CALC], "tool_choice": "none"}
    answer = rollout.chat(body)
    assert answer == {"content": CALL, "calls": []}
    body["messages"] += [{"role": "assistant", "content": CALL},
                         {"role": "user", "content": "Go on."}]
    assert rollout.chat(body)["content"] == ANSWER
    assert rollout.close() == [] and rollout.tree.branches == []


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"frequency_penalty": 0.1, "presence_penalty": 0.1}, "frequency_penalty", "penalties"),
    ({"presence_penalty": -0.5}, "presence_penalty", "penalties"),
    ({"logit_bias": {"50256": -100}}, "logit_bias", "logit biases"),
    ({"logprobs": True, "top_logprobs": 2}, "top_logprobs", "not the most likely"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "messages", "part of type 'image_url'"),
    ({"functions": [{"name": "calc", "parameters": PARAMETERS}], "function_call": "auto"},
     "functions", "legacy function calling"),
])
def test_what_the_engine_cannot_do_is_a_400_naming_the_field(tokenizer, gateway, fields,
                                                             param, words):
    rollout = Rollout(tokenizer, gateway)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    reply = rollout.post("chat/completions", body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert words in error["message"] and "\n" not in error["message"], error
    assert error["param"] == param
    [line] = rollout.close()
    assert line.startswith("400: ") and rollout.sampler.prompts == []


def test_zero_penalties_and_an_empty_logit_bias_are_taken(tokenizer, gateway):
    rollout = Rollout(tokenizer, gateway, replies=(ANSWER,))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
            "top_logprobs": 0, "response_format": {"type": "json_object"}}
    assert rollout.chat(body)["content"] == ANSWER
    assert rollout.close() == []


def test_a_responses_call_for_openai_server_state_is_refused_and_recorded(tokenizer, gateway):
    rollout = Rollout(tokenizer, gateway)
    for field, value, words in (("conversation", "conv_123", "keeps no conversations"),
                                ("prompt", {"id": "pmpt_1"}, "keeps no stored prompts")):
        reply = rollout.post("responses", {"model": MODEL, "input": "hi", field: value})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field
        assert words in reply.json()["error"]["message"]
    assert len(rollout.close()) == 2 and rollout.sampler.prompts == []


def test_a_malformed_body_fails_its_rollout_on_either_route(tokenizer, gateway):
    rollout = Rollout(tokenizer, gateway)
    for route in ("chat/completions", "responses"):
        reply = httpx.post(f"{rollout.url}/{route}", content=b'{"model": "policy", "mess',
                           headers={"content-type": "application/json"})
        assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]
    assert [line[:4] for line in rollout.close()] == ["400:", "400:"]


NAMED = {"type": "function", "function": {"name": "calc"}}
NAMED_OPENING = '<tool_call>{"name": "calc", "arguments":'
FORCED_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "6*7?"}],
               "tools": [CALC]}


@pytest.mark.parametrize(("choice", "opening"), [(NAMED, NAMED_OPENING),
                                                 ("required", REQUIRED_OPENING)],
                         ids=["named", "required"])
def test_a_forced_tool_choice_ends_the_prompt_with_the_calls_opening(tokenizer, gateway,
                                                                     choice, opening):
    """The opening is prompt (in `prompt_token_ids`, never trained); the model samples the
    rest; the program gets a call of the function, parsed from forced + sampled text."""
    rollout = Rollout(tokenizer, gateway, replies=(CALL.removeprefix(opening),))
    reply = rollout.post("chat/completions", {**FORCED_BODY, "tool_choice": choice})
    assert reply.status_code == 200, reply.text
    [choice_0] = reply.json()["choices"]
    assert choice_0["finish_reason"] == "tool_calls"
    assert [c["function"] for c in choice_0["message"]["tool_calls"]] == [
        {"name": "calc", "arguments": '{"expr": "6*7"}'}]
    forced = tokenizer.encode(opening, add_special_tokens=False)
    [prompt], [sampled] = rollout.sampler.prompts, rollout.sampler.sampled
    assert prompt[-len(forced):] == forced and choice_0["prompt_token_ids"] == prompt
    assert choice_0["token_ids"] == sampled
    assert len(choice_0["logprobs"]["content"]) == len(sampled)
    [seq] = rollout.tree.sequences()
    assert seq.tokens[:len(prompt) + len(sampled)] == prompt + sampled
    assert [t for t, m in zip(seq.tokens, seq.sampled_mask) if m] == sampled
    assert not any(seq.sampled_mask[len(prompt) - len(forced):len(prompt)])
    assert rollout.close() == [] and rollout.tree.forced_misses == 0


def test_the_responses_apis_named_choice_is_forced_too(tokenizer, gateway):
    rollout = Rollout(tokenizer, gateway, replies=(CALL.removeprefix(NAMED_OPENING),))
    tool = {"type": "function", "name": "calc", "parameters": PARAMETERS}
    reply = rollout.post("responses", {"model": MODEL, "input": "6*7?", "tools": [tool],
                                       "tool_choice": {"type": "function", "name": "calc"}})
    assert reply.status_code == 200, reply.text
    [item] = reply.json()["output"]
    assert (item["type"], item["name"], item["arguments"]) == \
        ("function_call", "calc", '{"expr": "6*7"}')
    forced = tokenizer.encode(NAMED_OPENING, add_special_tokens=False)
    assert rollout.sampler.prompts[0][-len(forced):] == forced
    assert rollout.close() == []


def test_a_forced_reply_that_breaks_its_call_is_text_counted_and_continued(tokenizer, gateway):
    broken = ' {"expr": 6*7}}</tool_call>'  # not JSON: the call does not parse
    rollout = Rollout(tokenizer, gateway, replies=(broken, ANSWER))
    body = {**FORCED_BODY, "tool_choice": NAMED}
    first = rollout.chat(body)
    assert first == {"content": NAMED_OPENING + broken, "calls": []}
    assert rollout.tree.forced_misses == 1
    body["messages"] = [*body["messages"], {"role": "assistant", "content": first["content"]},
                        {"role": "user", "content": "Try again."}]
    body["tool_choice"] = "auto"
    assert rollout.chat(body) == TEXT_ANSWER
    assert rollout.close() == [] and rollout.tree.branches == []
    [seq] = rollout.tree.sequences()
    assert [t for t, m in zip(seq.tokens, seq.sampled_mask) if m] == \
        [t for ids in rollout.sampler.sampled for t in ids]


class CannotForce(HermesSyntax):
    """Hermes blocks, without a way to force one (the base class's answer)."""

    name = "no_force"

    def forced_opening(self, name):
        return ToolCallSyntax.forced_opening(self, name)


@pytest.mark.parametrize(("route", "fields", "syntax", "words"), [
    ("chat/completions", {"tool_choice": "required"}, CannotForce(),
     "tool_choice 'required' cannot be forced in the 'no_force' tool-call syntax"),
    ("responses", {"tool_choice": "required"}, CannotForce(), "in the 'no_force' tool-call"),
    ("chat/completions", {"tool_choice": {"type": "function", "function": {"name": "f-1"}},
                          "tools": [{"type": "function", "function": {"name": "f-1"}}]},
     Olmo3Syntax(), "the function 'f-1' cannot be forced in the 'olmo3' tool-call syntax"),
    ("chat/completions", {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
     None, "'nope', which is not among the request's tools"),
    ("chat/completions", {"tool_choice": "required", "tools": None}, None, "needs tools"),
], ids=["chat", "responses", "unwritable-name", "unknown-function", "no-tools"])
def test_a_tool_choice_that_cannot_be_forced_is_a_400_line(tokenizer, gateway, route, fields,
                                                           syntax, words):
    rollout = Rollout(tokenizer, gateway)
    if syntax is not None:
        rollout.tree.syntax = syntax
    body = ({"model": MODEL, "input": "6*7?", "tools": [{"type": "function", "name": "calc"}]}
            if route == "responses" else FORCED_BODY)
    reply = rollout.post(route, {**body, **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert words in error["message"] and "\n" not in error["message"], error
    assert error["param"] == "tool_choice"
    [line] = rollout.close()
    assert line.startswith("400: ") and rollout.sampler.prompts == []
