"""Conversation: tokens only grow, sampled ids stay verbatim, prompts extend each other."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from prefixgym.prompting import Conversation, HFTemplateFormat, Segment
from prefixgym.prompting.tokenizer import load_tokenizer
from prefixgym.prompting.tools import Tool, tool
from prefixgym.types import ModelInput

IM_START, IM_END, EOS = 1, 2, 0


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@tool
def lookup(key: str) -> str:
    """Look up the value stored under a key.

    Args:
        key: The key to look up.
    """
    return "42"


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# -- random conversations ----------------------------------------------------------

texts = st.text(st.characters(codec="utf-8"), max_size=30) | st.sampled_from(
    ["", " ", "\n", "  \n\t", "héllo wörld", "數字 123", "🙂🙂", "higher", "<|im_end|>"]
)
sample_ids = st.lists(st.integers(3, 4095), max_size=12)
events = st.lists(
    st.one_of(
        st.tuples(st.just("user"), texts),
        st.tuples(st.just("tool"), texts),
        st.tuples(st.just("sample"), sample_ids, st.sampled_from(["im_end", "eos", "stop", "length"])),
    ),
    min_size=1,
    max_size=10,
)


def run_events(conv: Conversation, evs) -> None:
    previous_prompt: list[int] | None = None
    previous_sample: list[int] = []
    for ev in evs:
        before = conv.tokens
        segments_before = len(conv.segments)
        if ev[0] == "user":
            conv.add_user(ev[1])
        elif ev[0] == "tool":
            conv.add_tool_result("lookup", ev[1])
        else:
            prompt = conv.generation_prompt().tokens
            assert prompt[: len(before)] == before and len(prompt) > len(before)
            if previous_prompt is not None:  # extends the last prompt + what was sampled
                assert prompt[: len(previous_prompt) + len(previous_sample)] == (
                    previous_prompt + previous_sample
                )
            ids, ending = list(ev[1]), ev[2]
            if ending == "im_end":
                ids.append(IM_END)
            elif ending == "eos":
                ids.append(EOS)
            conv.add_sampled(ids, stop_reason="length" if ending == "length" else "stop")
            reply = [s for s in conv.segments[segments_before:] if s.kind == "reply"]
            assert len(reply) == 1 and reply[0].sampled
            assert conv.tokens[reply[0].start : reply[0].end] == ids  # verbatim
            assert reply[0].closing_added == (ending != "im_end")
            after_reply = conv.tokens[reply[0].end :]
            assert after_reply[-1:] == encode(conv.tokenizer, "\n")
            assert after_reply[0] == (IM_END if ending != "im_end" else after_reply[0])
            previous_prompt, previous_sample = prompt, ids
        assert conv.tokens[: len(before)] == before  # only grows
        assert len(conv.tokens) > len(before)
    final = conv.generation_prompt().tokens
    if previous_prompt is not None:
        assert final[: len(previous_prompt) + len(previous_sample)] == (
            previous_prompt + previous_sample
        )
    assert conv.extension_ok and conv.first_divergence is None
    # segments tile the token list
    position = 0
    for seg in conv.segments:
        assert seg.start == position
        assert seg.end > seg.start or seg.kind == "reply"  # an empty sample is kept
        position = seg.end
    assert position == len(conv.tokens)


@given(system=st.none() | texts, evs=events)
def test_random_conversations_only_grow_and_prompts_extend(system, evs):
    conv = Conversation(load_tokenizer(), system=system, tools=[lookup])
    run_events(conv, evs)


@given(evs=events)
def test_random_conversations_through_the_hf_adapter(evs):
    tok = load_tokenizer()
    conv = Conversation(tok, system="Be brief.", tools=[lookup], chat_template=tok.chat_template)
    assert isinstance(conv.format, HFTemplateFormat)
    run_events(conv, evs)


# -- the fixed prefix ----------------------------------------------------------------

_PREFIX_SCRIPT = """
import json
from prefixgym.prompting.tokenizer import load_tokenizer
from prefixgym.prompting import Conversation
from prefixgym.prompting.tools import Tool
from pydantic import BaseModel

class Args(BaseModel):
    key: str
    tags: set[str] = set()

tool = Tool.from_model(Args, name="lookup", description="Look up a key.")
conv = Conversation(load_tokenizer(), system="You are a key-value agent.", tools=[tool])
print(json.dumps(conv.tokens))
"""


def test_fixed_prefix_is_identical_across_processes(tok):
    # Two processes with different string hashing (set iteration order), run side by side.
    procs = [
        subprocess.Popen([sys.executable, "-c", _PREFIX_SCRIPT], stdout=subprocess.PIPE,
                         text=True, env=dict(os.environ, PYTHONHASHSEED=seed))
        for seed in ["1", "2"]
    ]
    outputs = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert outputs[0] == outputs[1]
    assert outputs[0][0] == IM_START and outputs[0][-2] == IM_END
    assert "You are a key-value agent." in tok.decode(outputs[0])


def test_fixed_prefix_comes_first_and_is_the_same_for_every_episode(tok):
    a = Conversation(tok, system="Guess the number.", tools=[lookup])
    b = Conversation(tok, system="Guess the number.", tools=[lookup])
    a.add_user("episode one")
    b.add_user("a different episode")
    assert a.fixed_prefix == b.fixed_prefix and len(a.fixed_prefix) > 20
    assert a.tokens[: len(a.fixed_prefix)] == a.fixed_prefix
    assert a.segments[0] == Segment("system", 0, len(a.fixed_prefix), kind="prefix")
    assert '"name":"lookup"' in tok.decode(a.fixed_prefix)


# -- sampled ids are never re-tokenized -----------------------------------------------

def test_sampled_ids_that_reencode_differently_stay_verbatim(tok):
    rng = random.Random(0)
    for _ in range(1000):
        ids = [rng.randrange(3, 4096) for _ in range(rng.randint(2, 6))]
        if encode(tok, tok.decode(ids)) != ids:
            break
    else:
        pytest.fail("no id sequence whose decode-then-encode differs")
    conv = Conversation(tok, system="S")
    conv.add_user("go")
    first = conv.generation_prompt().tokens
    conv.add_sampled(ids, stop_reason="length")
    conv.add_user("next")
    prompt = conv.generation_prompt().tokens
    assert prompt[len(first) : len(first) + len(ids)] == ids
    retokenized = encode(tok, tok.decode(ids))
    assert prompt[len(first) : len(first) + len(retokenized)] != retokenized
    assert conv.extension_ok


# -- replies, views and errors --------------------------------------------------------

def test_reply_that_ended_on_im_end_gets_only_the_newline(tok):
    conv = Conversation(tok)
    assert conv.tokens == [] and conv.generation_prompt().tokens == [IM_START, *encode(
        tok, "assistant\n")]
    conv.add_sampled(encode(tok, "left") + [IM_END], stop_reason="stop")
    assert conv.tokens[-2:] == [IM_END, *encode(tok, "\n")]
    assert conv.last_reply_text == "left"
    assert conv.messages == [{"role": "assistant", "content": "left"}]
    assert [s.kind for s in conv.segments] == ["header", "reply", "closing"]


def test_reply_cut_by_max_tokens_is_closed_and_recorded(tok):
    conv = Conversation(tok, system="S")
    reply = encode(tok, "I think the answer")
    conv.add_sampled(reply, stop_reason="length")
    seg = next(s for s in conv.segments if s.kind == "reply")
    assert seg.closing_added and seg.sampled and seg.stop_reason == "length"
    assert conv.tokens[seg.end :] == [IM_END, *encode(tok, "\n")]
    assert conv.last_reply_text == "I think the answer"
    assert conv.stop_token_ids == [IM_END, EOS]


def test_a_forced_opening_is_prompt_before_the_reply_and_part_of_its_text(tok):
    """A server that forces a tool call's opening: those ids follow the header as a
    segment of their own, never sampled; the reply's text reads them; the next prompt
    extends prompt + forced + sampled."""
    conv = Conversation(tok, system="S")
    conv.add_user("6*7?")
    prompt = conv.generation_prompt().tokens
    forced, reply = encode(tok, '<tool_call>{"name": "'), encode(tok, 'calc"}</tool_call>')
    conv.add_sampled(reply + [IM_END], stop_reason="stop", forced=forced)
    assert conv.tokens[:len(prompt) + len(forced) + len(reply)] == prompt + forced + reply
    kinds = [(s.kind, s.sampled) for s in conv.segments]
    assert kinds[-4:] == [("header", False), ("forced", False), ("reply", True),
                          ("closing", False)]
    assert conv.last_reply_text == '<tool_call>{"name": "calc"}</tool_call>'
    assert conv.messages[-1]["content"] == conv.last_reply_text
    conv.add_user("and?")
    conv.generation_prompt()
    assert conv.extension_ok


def test_written_assistant_reply_is_a_reply_but_not_sampled(tok):
    conv = Conversation(tok, system="S")
    conv.add_user("move")
    conv.add_assistant("up")
    seg = next(s for s in conv.segments if s.kind == "reply")
    assert not seg.sampled and not seg.closing_added
    assert conv.tokens[seg.start : seg.end] == encode(tok, "up") + [IM_END]
    assert conv.last_reply_text == "up"


def test_encode_reply_is_what_add_assistant_appends(tok):
    a, b = Conversation(tok, system="S"), Conversation(tok, system="S")
    reply = a.encode_reply("guess 500")
    assert reply == encode(tok, "guess 500") + [IM_END] and a.tokens == b.tokens
    a.add_sampled(reply, stop_reason="stop")
    b.add_assistant("guess 500")
    assert a.tokens == b.tokens


def test_tool_result_without_a_name(tok):
    conv = Conversation(tok)
    conv.add_tool_result("", "42")
    assert conv.tokens == [IM_START, *encode(tok, "tool\n42"), IM_END, *encode(tok, "\n")]


def test_messages_view(tok):
    conv = Conversation(tok, system="S", tools=[lookup])
    conv.add_user("key a?")
    conv.add_sampled(encode(tok, '<tool_call>{"name": "lookup"}</tool_call>'), "stop")
    conv.add_tool_result("lookup", "42")
    assert conv.messages == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "key a?"},
        {"role": "assistant", "content": '<tool_call>{"name": "lookup"}</tool_call>'},
        {"role": "tool", "name": "lookup", "content": "42"},
    ]


def test_reply_for_a_stale_prompt_breaks_the_extension_check(tok):
    conv = Conversation(tok, system="S")
    start = len(conv.tokens)
    conv.generation_prompt()
    conv.add_user("a message added after the prompt was sampled from")
    conv.add_sampled(encode(tok, "ok") + [IM_END], "stop")
    conv.generation_prompt()
    assert not conv.extension_ok
    # The issued prompt had <|im_start|>assistant here; the tokens have <|im_start|>user.
    assert conv.first_divergence == start + 1


def test_bad_samples_raise_and_leave_the_conversation_unchanged(tok):
    conv = Conversation(tok, system="S")
    before = conv.tokens
    with pytest.raises(ValueError, match=r"tokens\[1\] = 4096 is outside"):
        conv.add_sampled([5, 4096])
    with pytest.raises(ValueError, match=r"tokens\[0\] is -1|outside"):
        conv.add_sampled([-1])
    with pytest.raises(ValueError, match="token ids are ints"):
        conv.add_sampled([1.5])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="got text"):
        conv.add_sampled("hello")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stop_reason"):
        conv.add_sampled([5], stop_reason="eos")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="content must be a str"):
        conv.add_user(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name must be a str"):
        conv.add_tool_result(None, "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no assistant reply"):
        _ = conv.last_reply_text
    assert conv.tokens == before and conv.messages == [{"role": "system", "content": "S"}]


def test_constructor_errors(tok):
    with pytest.raises(ValueError, match="not both"):
        Conversation(tok, chat_format=object(), chat_template="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tools\\[0\\] is dict, expected a prefixgym Tool, "
                                         "a typed function or a pydantic model class"):
        Conversation(tok, tools=[{"name": "lookup"}])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="tools\\[1\\]: tool 'untyped': parameter 'x' needs"):
        Conversation(tok, tools=[lookup, untyped])


def untyped(x):  # type: ignore[no-untyped-def]
    return x


class Find(BaseModel):
    """Find a key."""

    key: str


def plain_lookup(key: str) -> str:
    """Look up the value stored under a key.

    Args:
        key: The key to look up.
    """
    return "42"


@pytest.mark.parametrize("through_template", [False, True])
def test_plain_functions_and_pydantic_models_are_tools(tok, through_template):
    # converted exactly as @tool and Tool.from_model do, for both chat formats
    template = tok.chat_template if through_template else None
    given = Conversation(tok, system="S", tools=[plain_lookup, Find], chat_template=template)
    made = Conversation(tok, system="S", tools=[tool(plain_lookup), Tool.from_model(Find)],
                        chat_template=template)
    assert given.tokens == made.tokens
    assert [t.schema() for t in given.tools] == [t.schema() for t in made.tools]
    assert given.tools[0].call({"key": "a"}) == "42"
    assert '"name":"find"' in tok.decode(given.fixed_prefix)


def test_generation_prompt_is_a_model_input(tok):
    prompt = Conversation(tok, system="S").generation_prompt()
    assert isinstance(prompt, ModelInput) and prompt.length > 0


def test_an_observation_is_appended_as_its_messages(tok):
    observation = ({"role": "user", "name": "", "content": "Guess."},
                   {"role": "tool", "name": "", "content": "no name"},
                   {"role": "tool", "name": "lookup", "content": "42"})
    by_messages, by_hand = Conversation(tok, system="S"), Conversation(tok, system="S")
    by_messages.add_messages(observation)
    by_hand.add_user("Guess.")
    by_hand.add_tool_result("", "no name")
    by_hand.add_tool_result("lookup", "42")
    assert by_messages.tokens == by_hand.tokens
    assert by_messages.messages == by_hand.messages
    assert "name" not in by_messages.messages[2] and by_messages.messages[3]["name"] == "lookup"
    with pytest.raises(ValueError, match="role 'robot'"):
        by_messages.add_messages([{"role": "robot", "content": "beep"}])
