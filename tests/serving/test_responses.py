"""`/v1/responses` over a chat handler: the chat bodies it sends (instructions, the
conversation of `previous_response_id`, merged tool calls), the Response and stream events
the official openai client reads, the store, and refusals. The chat handler is a fake that
records each body (checking that the chat route would accept it) and answers a canned reply."""

from __future__ import annotations

import copy
import json

import pytest
from fastapi import FastAPI, Request
from pydantic import TypeAdapter
from starlette.testclient import TestClient

from prefixgym.serving.chat import ChatRequest
from prefixgym.serving.errors import install_error_handlers
from prefixgym.serving.protocol import APIError
from prefixgym.serving.responses import ResponseStore, add_responses_route
from prefixgym.serving.responses_protocol import StoredResponse
from prefixgym.types import JSONObject

openai = pytest.importorskip("openai")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

TOOL = {"type": "function", "name": "add", "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                        "b": {"type": "integer"}}},
        "strict": True}
CHAT_TOOL = {"type": "function", "function": {k: TOOL[k] for k in ("name", "description",
                                                                   "parameters")}}
CALL = {"id": "call_7", "type": "function",
        "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}


def chat_answer(content: str | None, calls: list[JSONObject] | None = None,
                finish: str = "stop", reasoning: str | None = None) -> JSONObject:
    message: JSONObject = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = reasoning
    logprobs = [{"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []}
                for t in ("He", "llo", "!")]
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "tiny",
            "choices": [{"index": 0, "message": message, "token_ids": [50, 51, 52],
                         "prompt_token_ids": [1, 2, 3, 4], "logprobs": {"content": logprobs},
                         "finish_reason": "tool_calls" if calls else finish}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                      "prompt_tokens_details": {"cached_tokens": 2}},
            "metadata": {"weight_version": "v3"}}


class FakeChat:
    """Records each chat body and answers the next canned answer."""

    def __init__(self) -> None:
        self.bodies: list[JSONObject] = []
        self.answers: list[JSONObject | APIError] = []

    async def __call__(self, request: Request, body: JSONObject) -> JSONObject:
        self.bodies.append(copy.deepcopy(body))
        ChatRequest.model_validate(body)  # a body the chat route takes
        answer = self.answers.pop(0)
        if isinstance(answer, APIError):
            raise answer
        return answer


def authorize(request: Request) -> None:
    if request.headers.get("authorization") != "Bearer k":
        raise APIError(401, "missing or incorrect API key", None, "authentication_error")


@pytest.fixture
def fake() -> FakeChat:
    return FakeChat()


@pytest.fixture
def http(fake: FakeChat) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    store = ResponseStore()
    add_responses_route(app, "/v1/responses", fake, authorize, 64 * 1024, store)
    add_responses_route(app, "/rollouts/{key}/v1/responses", fake, authorize, 64 * 1024, store)
    return TestClient(app, headers={"authorization": "Bearer k"})


@pytest.fixture
def client(http: TestClient):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http,
                         max_retries=0)


def test_text_input_instructions_and_the_response_the_sdk_reads(fake, http, client):
    fake.answers.append(chat_answer("Hello!"))
    r = client.responses.create(model="tiny", input="hi", instructions="Be brief.",
                                max_output_tokens=5, temperature=0.5, metadata={"run": "1"},
                                include=["message.output_text.logprobs"])
    assert fake.bodies == [{
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "hi"}],
        "n": 1, "stream": False, "model": "tiny", "temperature": 0.5, "max_tokens": 5,
        "logprobs": True}]
    assert r.output_text == "Hello!" and r.status == "completed" and r.id.startswith("resp_")
    assert [t.token for t in r.output[0].content[0].logprobs] == ["He", "llo", "!"]
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (4, 3, 7)
    assert r.usage.input_tokens_details.cached_tokens == 2
    assert r.metadata == {"run": "1", "weight_version": "v3"}
    assert (r.instructions, r.max_output_tokens, r.temperature) == ("Be brief.", 5, 0.5)
    stored = http.get(f"/v1/responses/{r.id}")
    assert stored.status_code == 200
    Response.model_validate(stored.json())  # the SDK's own model takes it, validated
    assert stored.json()["output"][0]["content"][0]["text"] == "Hello!"
    assert "input_messages" not in stored.json()


def test_tool_calls_and_their_outputs_continue_through_previous_response_id(fake, client):
    fake.answers += [chat_answer(None, [CALL]), chat_answer("five"), chat_answer("bye")]
    first = client.responses.create(model="tiny", input=[{"role": "user", "content": "2+3?"}],
                                    instructions="You add.", tools=[TOOL], tool_choice="auto")
    assert fake.bodies[0]["tools"] == [CHAT_TOOL] and fake.bodies[0]["tool_choice"] == "auto"
    [call] = first.output
    assert (call.type, call.call_id, call.name, call.arguments) == (
        "function_call", "call_7", "add", '{"a": 2, "b": 3}')
    assert call.id.startswith("fc_") and first.output_text == ""
    assert first.tools[0].name == "add" and first.tools[0].strict is True

    second = client.responses.create(
        model="tiny", previous_response_id=first.id, instructions="Answer in words.",
        tools=[TOOL], input=[{"type": "function_call_output", "call_id": "call_7",
                              "output": "5"}])
    assistant = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    tool = {"role": "tool", "tool_call_id": "call_7", "content": "5"}
    assert fake.bodies[1]["messages"] == [  # the first request's instructions stay behind
        {"role": "system", "content": "Answer in words."},
        {"role": "user", "content": "2+3?"}, assistant, tool]
    assert second.output_text == "five" and second.previous_response_id == first.id

    client.responses.create(model="tiny", previous_response_id=second.id, input="thanks")
    assert fake.bodies[2]["messages"] == [
        {"role": "user", "content": "2+3?"}, assistant, tool,
        {"role": "assistant", "content": "five"}, {"role": "user", "content": "thanks"}]
    assert "tools" not in fake.bodies[2]  # tools are not carried over, as OpenAI's are not


def test_a_context_sent_whole_merges_calls_into_one_assistant_message(fake, client):
    fake.answers.append(chat_answer("done"))
    said = client.responses.create(model="tiny", input="hi")  # output items as the SDK has them
    fake.answers.append(chat_answer("ok"))
    second_call = {"type": "function_call", "call_id": "call_8", "name": "add",
                   "arguments": "{}", "id": "fc_1", "status": "completed"}
    client.responses.create(model="tiny", tools=[TOOL],
                            tool_choice={"type": "function", "name": "add"}, input=[
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "hi"}, {"type": "input_text", "text": "!"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        said.output[0].model_dump(exclude_none=True),
        {"type": "function_call", "call_id": "call_7", "name": "add",
         "arguments": '{"a": 2, "b": 3}'},
        second_call,
        {"type": "function_call_output", "call_id": "call_7", "output": "5"},
        {"type": "function_call_output", "call_id": "call_8",
         "output": [{"type": "input_text", "text": "0"}]},
        {"role": "developer", "content": "go on"}])
    assert fake.bodies[1]["messages"] == [
        {"role": "user", "content": "hi!"},
        {"role": "assistant", "content": "done", "tool_calls": [
            CALL, {"id": "call_8", "type": "function",
                   "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "5"},
        {"role": "tool", "tool_call_id": "call_8", "content": "0"},
        {"role": "developer", "content": "go on"}]
    assert fake.bodies[1]["tool_choice"] == {"type": "function", "function": {"name": "add"}}


ADAPTER = TypeAdapter(ResponseStreamEvent)


def test_a_stream_replays_the_response_in_events_the_sdk_parses(fake, http, client):
    fake.answers.append(chat_answer("Hello!", [CALL], reasoning="2+3 is 5"))
    events = list(client.responses.create(model="tiny", input="hi", tools=[TOOL], stream=True))
    for event in events:
        ADAPTER.validate_python(event.to_dict())  # each event, validated by the SDK's types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert events[8].delta == "Hello!" and events[13].delta == CALL["function"]["arguments"]
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "2+3 is 5"
    assert http.get(f"/v1/responses/{final.id}").json() == final.to_dict(mode="json")

    fake.answers.append(chat_answer("Hello!"))  # the SDK's helper assembles the same answer
    with client.responses.stream(model="tiny", input="hi") as stream:
        assert stream.get_final_response().output_text == "Hello!"


def test_a_reply_cut_by_max_output_tokens_is_incomplete_with_its_token_ids(fake, http):
    fake.answers += [chat_answer("Hel", finish="length")] * 2
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 3,
            "enable_response_messages": True}
    r = http.post("/v1/responses", json=body).json()
    Response.model_validate(r)
    assert fake.bodies[0]["return_token_ids"] is True and fake.bodies[0]["max_tokens"] == 3
    assert r["status"] == "incomplete" and r["output"][0]["status"] == "incomplete"
    assert r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["input_messages"] == [{"type": "raw_message_tokens", "message": "",
                                    "tokens": [1, 2, 3, 4]}]
    assert r["output_messages"] == [{"type": "raw_message_tokens", "message": "Hel",
                                     "tokens": [50, 51, 52]}]
    streamed = http.post("/v1/responses", json={**body, "stream": True})
    datas = [json.loads(line[6:]) for line in streamed.text.splitlines()
             if line.startswith("data: ")]
    assert datas[-1]["type"] == "response.incomplete"
    assert datas[-1]["response"]["status"] == "incomplete"


def test_responses_are_kept_per_base_url_and_only_when_stored(fake, http):
    fake.answers += [chat_answer("a"), chat_answer("b"), chat_answer("c")]
    made = http.post("/rollouts/a/v1/responses", json={"input": "hi"}).json()["id"]
    assert http.get(f"/rollouts/a/v1/responses/{made}").status_code == 200
    assert http.get(f"/rollouts/b/v1/responses/{made}").status_code == 404
    other = http.post("/rollouts/b/v1/responses", json={"input": "x",
                                                        "previous_response_id": made})
    assert other.status_code == 400 and other.json()["error"]["param"] == "previous_response_id"
    assert http.post("/rollouts/a/v1/responses", json={
        "input": "x", "previous_response_id": made}).status_code == 200
    unkept = http.post("/v1/responses", json={"input": "hi", "store": False}).json()["id"]
    assert http.get(f"/v1/responses/{unkept}").status_code == 404


def test_the_store_forgets_the_least_recently_used():
    store = ResponseStore(capacity=2)
    for key in ("a", "b"):
        store.put(key, StoredResponse([], {"id": key}))
    assert store.get("a") is not None  # now "b" is the oldest
    store.put("c", StoredResponse([], {"id": "c"}))
    assert (store.get("b"), len(store)) == (None, 2)
    assert store.get("a") is not None and store.get("c") is not None


@pytest.mark.parametrize(("payload", "param", "words"), [
    ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id",
     "Previous response with id 'resp_nope' not found."),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "'web_search' tool"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice", "a function"),
    ({"input": "hi", "tool_choice": "sometimes"}, "tool_choice", "'auto', 'none'"),
    ({"input": 5}, "input", "must be a string or a list of items"),
    ({"input": [{"type": "computer_call"}]}, "input", "'computer_call' item"),
    ({"input": ["hi"]}, "input", "item 0 is not an object"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "part of type 'input_image'"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input",
     "arguments"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input", "role"),
    ({"input": []}, "input", "no messages"),
    ({}, "input", "Field required"),
    ({"input": "hi", "max_output_tokens": "3"}, "max_output_tokens", "integer"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "keeps no conversations"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt", "keeps no stored prompts"),
])
def test_bad_requests_are_400s_in_one_line_before_any_chat(fake, http, payload, param, words):
    reply = http.post("/v1/responses", json=payload)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert words in error["message"] and "\n" not in error["message"]
    assert error["param"] == param and fake.bodies == []


def test_a_field_sent_as_null_is_a_field_not_sent(fake, http):
    fake.answers.append(chat_answer("Hello!"))
    reply = http.post("/v1/responses", json={
        "model": "tiny", "input": "hi", "stream": None, "store": None, "instructions": None,
        "temperature": None, "tools": None, "tool_choice": None, "include": None})
    assert reply.status_code == 200, reply.text
    assert fake.bodies == [{"messages": [{"role": "user", "content": "hi"}], "n": 1,
                            "stream": False, "model": "tiny"}]
    assert http.get(f"/v1/responses/{reply.json()['id']}").status_code == 200  # stored


def test_refusals_of_the_chat_handler_and_of_the_http_layer(fake, http, client):
    fake.answers.append(APIError(400, "max_tokens is 9999: over the limit", "max_tokens"))
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input="hi", max_output_tokens=9999)
    assert refused.value.body["param"] == "max_output_tokens"  # the Responses API's name
    assert http.post("/v1/responses", content=b'{"input": "hi"}').status_code == 415
    assert http.post("/v1/responses", json={"input": "hi"},
                     headers={"authorization": "Bearer wrong"}).status_code == 401
    assert http.post("/v1/responses", content=b"{", headers={
        "content-type": "application/json"}).json()["error"]["message"].startswith(
        "request body is not valid JSON")
