"""The probe conversations a chat template is rendered over.

Each probe is a multi-turn conversation cut into steps: the messages the agent
observes (user or tool), then the assistant's reply. Probes come with and without a
system message, with plain replies, replies that open with a `<think>` block, and a
tool call followed by its result. This module is data; it renders nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixgym.types import JSONObject

SYSTEM_TEXT = "You are a careful assistant. Answer in one short sentence."

LOOKUP_TOOL: JSONObject = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a fact in the encyclopedia.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "What to look up."}},
            "required": ["query"],
        },
    },
}


@dataclass(frozen=True)
class Reply:
    """An assistant message, and the text the probe looks for in the render."""

    message: JSONObject
    content: str | None  # None for a reply whose rendering the template decides (tool calls)
    reasoning: str | None = None


@dataclass(frozen=True)
class Step:
    observations: list[JSONObject]
    reply: Reply


@dataclass(frozen=True)
class Probe:
    name: str
    has_system: bool
    kind: str  # "plain" | "reasoning" | "tools"
    steps: list[Step]
    final_observations: list[JSONObject]
    tools: list[JSONObject] | None = field(default=None)

    def prefix_messages(self) -> list[JSONObject]:
        return [{"role": "system", "content": SYSTEM_TEXT}] if self.has_system else []


def _user(text: str) -> JSONObject:
    return {"role": "user", "content": text}


def _text_reply(text: str) -> Reply:
    return Reply({"role": "assistant", "content": text}, content=text)


def _thinking_reply(reasoning: str, answer: str) -> Reply:
    content = f"<think>\n{reasoning}\n</think>\n\n{answer}"
    return Reply({"role": "assistant", "content": content}, content=content, reasoning=reasoning)


def _tool_call_reply() -> Reply:
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "lookup", "arguments": {"query": "capital of France"}},
    }
    return Reply({"role": "assistant", "content": "", "tool_calls": [call]}, content=None)


def _steps(kind: str) -> tuple[list[Step], list[JSONObject]]:
    if kind == "plain":
        return [
            Step([_user("What is 2 + 2?")], _text_reply("2 + 2 = 4.")),
            Step([_user("And 3 + 3?")], _text_reply("3 + 3 = 6.")),
        ], [_user("Thanks!")]
    if kind == "reasoning":
        return [
            Step([_user("What is 2 + 2?")],
                 _thinking_reply("The user adds two and two; that makes four.", "2 + 2 = 4.")),
            Step([_user("And 3 + 3?")],
                 _thinking_reply("Three and three make six.", "3 + 3 = 6.")),
        ], [_user("Thanks!")]
    tool_result = {"role": "tool", "name": "lookup", "tool_call_id": "call_0", "content": "Paris"}
    return [
        Step([_user("What is the capital of France?")], _tool_call_reply()),
        Step([tool_result], _text_reply("The capital of France is Paris.")),
    ], [_user("Thanks!")]


def probe_conversations() -> list[Probe]:
    """Every probe: {no system, system} x {plain, reasoning, tools}."""
    probes = []
    for kind in ("plain", "reasoning", "tools"):
        for has_system in (False, True):
            steps, final = _steps(kind)
            name = f"{'system+' if has_system else ''}{kind}"
            tools = [LOOKUP_TOOL] if kind == "tools" else None
            probes.append(Probe(name, has_system, kind, steps, final, tools))
    return probes
