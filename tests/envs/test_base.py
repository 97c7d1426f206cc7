"""AgentEnv's shared machinery: tool calls, invalid replies, turn limits, transcript,
rendering, async reset/step, and the AnyText space."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import BaseModel

from prefixgym.envs import AgentEnv, AnyText, Outcome, messages_space
from prefixgym.prompting.tools import Tool, format_tool_call


def double(x: int) -> int:
    """Double a number.

    Args:
        x: The number.
    """
    if x < 0:
        raise ValueError("negative")
    return 2 * x


class Toy(AgentEnv):
    """Say the secret number; a `double` tool is available."""

    system_prompt = "Say the number."

    def __init__(self, max_turns: int = 3, render_mode: str | None = None) -> None:
        super().__init__(max_turns=max_turns, invalid_penalty=0.25,
                         tools=[Tool.from_function(double)], render_mode=render_mode)
        self.secret = 0

    def _reset_task(self) -> str:
        self.secret = int(self.np_random.integers(100))
        return "Go."

    def _act(self, text: str) -> Outcome:
        if not text.strip().isdigit():
            return Outcome("A number, please.", invalid=True)
        ok = int(text) == self.secret
        return Outcome("Yes." if ok else "No.", rewards={"success": float(ok)}, done=True,
                       success=ok)


def test_anytext_contains_any_string_and_samples_short_text() -> None:
    space = AnyText(max_length=20)
    assert all(s in space for s in ["", "hello, world!", "ü ß\n"])
    assert "x" * 21 not in space and 5 not in space
    space.seed(0)
    assert all(s in space and len(s) <= 20 for s in (space.sample() for _ in range(20)))
    obs = ({"role": "tool", "name": "double", "content": "a b, c"},)
    assert obs in messages_space() and () in messages_space()
    assert ({"role": "user", "content": "x"},) not in messages_space()


def test_reset_gives_first_user_message_and_info() -> None:
    env = Toy()
    obs, info = env.reset(seed=3)
    assert obs == ({"role": "user", "name": "", "content": "Go."},)
    assert info["stop_reason"] == "running" and info["is_success"] is False
    assert info["num_invalid_actions"] == 0 and info["turn"] == 0


def test_tool_call_returns_tool_message_with_zero_reward() -> None:
    env = Toy()
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(
        "let me see " + format_tool_call("double", {"x": 21}))
    assert obs == ({"role": "tool", "name": "double", "content": "42"},)
    assert (reward, terminated, truncated, info["invalid_action"]) == (0.0, False, False, False)
    assert info["num_tool_calls"] == 1 and info["num_tool_errors"] == 0


class Halve(BaseModel):
    """Halve a number."""

    x: int


class PlainTools(AgentEnv):
    """Tools given as a typed function and a pydantic model class, not as Tools."""

    def __init__(self, tools: list[Any]) -> None:
        super().__init__(tools=tools)

    def _reset_task(self) -> str:
        return "Go."

    def _act(self, text: str) -> Outcome:
        return Outcome("", done=True)


def test_function_and_model_tools_are_converted_as_tool_does() -> None:
    env = PlainTools([double, Halve])
    assert [t.schema() for t in env.tools] == [Tool.from_function(double).schema(),
                                               Tool.from_model(Halve).schema()]
    env.reset(seed=0)
    obs, reward, _, _, info = env.step(format_tool_call("double", {"x": 21}))
    assert obs == ({"role": "tool", "name": "double", "content": "42"},)
    assert info["num_tool_calls"] == 1 and info["num_tool_errors"] == 0
    with pytest.raises(ValueError, match=r"tools\[1\] is int, expected a prefixgym Tool"):
        PlainTools([double, 7])


def test_failing_tool_gives_error_message_but_is_not_invalid() -> None:
    env = Toy()
    env.reset(seed=0)
    obs, reward, _, _, info = env.step(format_tool_call("double", {"x": -1}))
    assert obs[0]["role"] == "tool" and obs[0]["content"].startswith("Error:")
    assert "ValueError: negative" in obs[0]["content"]
    assert reward == 0.0 and not info["invalid_action"] and info["num_tool_errors"] == 1


@pytest.mark.parametrize(
    "reply",
    ["<tool_call>{oops</tool_call>", '<tool_call>{"name": "triple", "arguments": {}}</tool_call>',
     format_tool_call("double", {"x": "many"}), '<tool_call>{"name": "double"'],
)
def test_bad_tool_calls_are_penalised_invalid_actions(reply: str) -> None:
    env = Toy()
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step(reply)
    assert obs[0]["role"] == "tool" and obs[0]["content"].startswith("Error:")
    assert reward == pytest.approx(-0.25) and not terminated
    assert info["invalid_action"] and info["num_invalid_actions"] == 1
    assert info["reward_components"] == {"invalid": -0.25}


def test_invalid_reply_then_success_and_turn_counting() -> None:
    env = Toy()
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("hmm")
    assert obs[0]["content"] == "A number, please." and reward == pytest.approx(-0.25)
    obs, reward, terminated, truncated, info = env.step(str(env.secret))
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["is_success"] and info["stop_reason"] == "success"
    assert info["num_invalid_actions"] == 1 and info["turn"] == 2
    with pytest.raises(RuntimeError, match="reset"):
        env.step("1")


def test_max_turns_truncates() -> None:
    env = Toy(max_turns=2)
    env.reset(seed=0)
    assert env.step("?")[3] is False
    _, _, terminated, truncated, info = env.step("?")
    assert (terminated, truncated, info["stop_reason"]) == (False, True, "max_turns")
    assert info["is_success"] is False


def test_non_string_action_is_a_value_error() -> None:
    env = Toy()
    env.reset(seed=0)
    with pytest.raises(ValueError, match="action must be str"):
        env.step(7)  # type: ignore[arg-type]
    assert env.turn == 0


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ValueError, match="max_turns"):
        Toy(max_turns=0)
    with pytest.raises(ValueError, match="render_mode"):
        Toy(render_mode="human")


def test_render_ansi_and_transcript() -> None:
    env = Toy(render_mode="ansi")
    env.reset(seed=1)
    env.step(format_tool_call("double", {"x": 2}))
    text = env.render()
    assert text is not None
    assert text.startswith("[system]\nSay the number.\n\n[tools] double\n\n[user]\nGo.")
    assert "[tool double]\n4" in text
    assert [m["role"] for m in env.transcript] == ["user", "assistant", "tool"]
    assert Toy().render() is None


def test_areset_and_astep_match_reset_and_step() -> None:
    async def episode(env: Toy) -> list[object]:
        out: list[object] = [await env.areset(seed=5)]
        out.append(await env.astep(format_tool_call("double", {"x": 1})))
        out.append(await env.astep(str(env.secret)))
        return out

    async def two() -> list[list[object]]:
        return list(await asyncio.gather(episode(Toy()), episode(Toy())))

    first, second = asyncio.run(two())
    sync_env = Toy()
    expected = [sync_env.reset(seed=5), sync_env.step(format_tool_call("double", {"x": 1})),
                sync_env.step(str(sync_env.secret))]
    assert first == second == expected
