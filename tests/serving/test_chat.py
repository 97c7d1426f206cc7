"""`prefixgym serve`'s /v1/chat/completions, driven by the official openai client and raw
HTTP: the chat template, n, seeds, logprobs, streaming, tools, the prefix cache, limits."""

from __future__ import annotations

import json

import httpx
import pytest

from prefixgym.serving.chat import _tool_calls

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "system", "content": "You add numbers."},
            {"role": "user", "content": "What is 2 + 3?"}]
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                   "b": {"type": "integer"}}}}}]


def chat(server, payload=None, **kwargs) -> httpx.Response:
    if payload is not None:
        kwargs["json"] = payload
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=60, **kwargs)


def test_messages_go_through_the_chat_template_and_repeat_from_the_cache(server, client):
    tok = server.service.tokenizer
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(prompt, add_special_tokens=False)
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                           temperature=0, extra_body={"return_token_ids": True})
    choice = first.choices[0]
    assert choice.model_extra["prompt_token_ids"] == ids
    assert first.usage.prompt_tokens == len(ids)
    tokens = choice.model_extra["token_ids"]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert choice.message.content == tok.decode(tokens, skip_special_tokens=True)
    again = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                           temperature=0)
    assert again.choices[0].model_extra["token_ids"] == tokens
    assert again.usage.prompt_tokens_details.cached_tokens >= len(ids) - 16


def test_n_seeds_and_the_sampled_tokens_logprobs(server, client):
    ask = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, "n": 3, "seed": 11,
           "logprobs": True}
    a = client.chat.completions.create(**ask)
    b = client.chat.completions.create(**ask)
    assert len(a.choices) == 3
    assert [c.model_extra["token_ids"] for c in a.choices] == \
        [c.model_extra["token_ids"] for c in b.choices]
    tok = server.service.tokenizer
    ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)
    sampler = server.service.create_sampling_client()
    for choice in a.choices:
        tokens = choice.model_extra["token_ids"]
        got = [t.logprob for t in choice.logprobs.content]
        full = sampler.compute_logprobs(ids + tokens).result()
        assert got == pytest.approx(full[len(ids):], abs=1e-4)
        assert [t.token for t in choice.logprobs.content] == \
            [tok.decode([t]) for t in tokens]


def test_a_stream_carries_the_same_answer_then_usage(client):
    ask = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and finishes[:-1] == [None, None]
    assert not chunks[-1].choices and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_tools_reach_the_template_and_tool_turns_render(server):
    plain = chat(server, {"messages": MESSAGES, "max_tokens": 1}).json()
    tooled = chat(server, {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 1}).json()
    assert tooled["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 20
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    reply = chat(server, {"messages": history, "tools": TOOLS, "max_tokens": 2})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(("choice", "opening"), [
    ({"type": "function", "function": {"name": "add"}}, '<tool_call>{"name": "add", "arguments":'),
    ("required", '<tool_call>{"name": "'),
], ids=["named", "required"])
def test_a_forced_tool_choice_ends_the_prompt_and_the_next_call_continues(server, client,
                                                                         choice, opening):
    """The call's opening in the model's syntax ends the prompt (never in `token_ids`);
    the reply is read after it (the tiny model's random weights seldom finish the call:
    then the text is the opening + what it sampled), and a client that sends the reply
    back continues the same tokens."""
    tok = server.service.tokenizer
    ask = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 8, "seed": 3,
           "extra_body": {"return_token_ids": True}}
    auto = client.chat.completions.create(**ask).choices[0].model_extra["prompt_token_ids"]
    first = client.chat.completions.create(**ask, tool_choice=choice).choices[0]
    prompt, sampled = first.model_extra["prompt_token_ids"], first.model_extra["token_ids"]
    assert prompt == auto + tok.encode(opening, add_special_tokens=False)
    if first.message.tool_calls:
        assert choice == "required" or first.message.tool_calls[0].function.name == "add"
        sent_back = first.message.model_dump(exclude_none=True)
    else:
        assert first.message.content.startswith(opening)
        sent_back = {"role": "assistant", "content": first.message.content}
    history = [*MESSAGES, sent_back, {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(**{**ask, "messages": history, "max_tokens": 2})
    later = second.choices[0].model_extra["prompt_token_ids"]
    assert later[:len(prompt) + len(sampled)] == prompt + sampled


def test_tool_call_blocks_become_openai_tool_calls():
    text = ('Let me add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
            '<tool_call>not json</tool_call>')
    rest, calls = _tool_calls(text)
    assert rest == "Let me add. <tool_call>not json</tool_call>"
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls] == [("function", "add", {"a": 2, "b": 3})]
    assert _tool_calls("no calls here ") == ("no calls here ", [])


@pytest.mark.parametrize(("payload", "status", "param"), [
    ({"max_tokens": 2}, 400, "messages"),                                 # no messages
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 9}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "2"}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400,
     "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400,
     "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": 3}, 400,
     "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5}, 400,
     "presence_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400,
     "tool_choice"),                                                      # no tools to call
    ({"messages": MESSAGES, "tools": TOOLS,
      "tool_choice": {"type": "function", "function": {"name": "mul"}}}, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x" * 70_000}]}, 413, None),  # body too large
    ([{"role": "user", "content": "hi"}], 400, None),                     # not an object
])
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, payload, status, param):
    reply = chat(server, payload)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["message"] and "\n" not in error["message"] and error["param"] == param
    assert chat(server, {"messages": MESSAGES, "max_tokens": 1}).status_code == 200


def test_a_field_sent_as_null_is_a_field_not_sent(server):
    reply = chat(server, {"messages": MESSAGES, "max_tokens": 1, "temperature": None,
                          "top_p": None, "n": None, "stream": None, "logprobs": None})
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == 1 and reply.json()["object"] == "chat.completion"


def test_hostile_bodies_are_one_line_errors(server):
    lone = b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'
    for body, status, words in (
            (lone, 400, "lone surrogate"),
            (b'{"messages": [', 400, "not valid JSON"),
            (b"[" * 100 + b"]" * 100, 400, "deep"),
            (b'\xff\xfe{"messages": 1}', 400, "UTF-8")):
        reply = chat(server, content=body, headers={"content-type": "application/json"})
        assert reply.status_code == status, (body[:20], reply.text)
        assert words in reply.json()["error"]["message"]
    unlabelled = chat(server, content=json.dumps({"messages": MESSAGES}).encode())
    assert unlabelled.status_code == 415


def test_responses_create_goes_through_the_chat_handler(server, client):
    """`prefixgym serve` answers the `openai` SDK's default API too: a plain input, then a
    follow-up by previous_response_id, whose prompt starts with the first one's."""
    first = client.responses.create(model="tiny", input="Name a colour.", instructions="Be brief.",
                                    max_output_tokens=6, temperature=0)
    assert first.status in ("completed", "incomplete") and first.usage.output_tokens > 0
    second = client.responses.create(model="tiny", input="Another?", previous_response_id=first.id,
                                     instructions="Be brief.", max_output_tokens=6, temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.BadRequestError, match="Previous response with id 'resp_nope'"):
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")


def test_history_sent_back_as_text_is_continued_as_the_sampled_ids(server, client):
    """A client resends its conversation as text; the server continues the tokens it
    sampled instead of re-tokenizing that text (serving/chat_history.py): shown on a
    reply whose text re-encodes to other ids."""
    tok = server.service.tokenizer
    for seed in range(40):
        first = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=12, seed=seed,
            extra_body={"return_token_ids": True})
        choice = first.choices[0]
        sampled, text = choice.model_extra["token_ids"], choice.message.content
        ended = sampled[-1:] == [tok.convert_tokens_to_ids("<|im_end|>")]
        if list(tok.encode(text, add_special_tokens=False)) != sampled[:len(sampled) - ended]:
            break
    else:
        pytest.fail("no reply in 40 seeds re-encodes to other ids")
    history = [*MESSAGES, {"role": "assistant", "content": text},
               {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model="tiny", messages=history, max_tokens=2,
                                            extra_body={"return_token_ids": True})
    prompt = second.choices[0].model_extra["prompt_token_ids"]
    first_prompt = choice.model_extra["prompt_token_ids"]
    assert prompt[:len(first_prompt) + len(sampled)] == first_prompt + sampled
    assert second.usage.prompt_tokens_details.cached_tokens >= len(first_prompt) - 16
