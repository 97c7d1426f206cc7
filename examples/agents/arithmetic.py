"""The tools recipe's task as an agent program over the `openai` client.

The recipe (`prefixgym train --config tools`) trains `tiny` on Arithmetic: two operands
in 1..20, a calculator, three turns. This program plays the same game through the chat
completions API: it sends the recipe's system prompt, which names the calculator in one
line; reads `<tool_call>` blocks from the reply's text and answers each with a `tool`
message; checks a final integer; and returns the reward the env would give (1 for the
right answer, minus `invalid_penalty` per invalid reply or malformed call). Its
conversations are token for token the env's, so the two learn alike
(docs/benchmarks.md, "An agent program against its env").

(The recipe's prompt names the tool without its JSON schema, for a model trained from
scratch; a program that sends OpenAI's `tools` field gets the schema rendered into the
system turn and its calls back as `tool_calls`: see examples/agents/calculator_tools.py.)

    prefixgym train --agent examples/agents/arithmetic.py:agent --tasks TASKS.jsonl
"""

from __future__ import annotations

import re

from openai import DefaultHttpxClient, OpenAI

from prefixgym.envs.arithmetic import calculator
from prefixgym.prompting.tools import Tool, ToolCall, parse_tool_calls

HTTP = DefaultHttpxClient()
"""One HTTP client for every rollout: a new `OpenAI` client would build its own, and
its SSL context costs ~10 ms of CPU, which a hundred rollouts a step notice."""
SYSTEM = ("Compute the value of the expression. You may call the calculator tool. Then reply "
          "with the final integer only. Tools: calculator(expression).")
INVALID = "Invalid. Reply with the final integer only, or call the calculator."
TOOLS = [Tool.from_function(calculator)]
INTEGER = re.compile(r"\s*([+-]?\d{1,30})\s*\.?\s*")


def agent(base_url: str, api_key: str, model: str, task: dict,
          max_turns: int = 3, invalid_penalty: float = 1.0) -> dict[str, float]:
    """One episode of `task` ({"question": "What is 3 * 4?", "answer": 12})."""
    client = OpenAI(base_url=base_url, api_key=api_key, http_client=HTTP)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
    invalid = 0
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        if "<tool_call>" in text:  # run each call; a reply with a malformed one is invalid
            calls = parse_tool_calls(text, TOOLS)
            for call in calls:
                if isinstance(call, ToolCall):
                    result = TOOLS[0].call(call.arguments)
                    messages.append({"role": "tool", "name": call.name, "content": result})
                else:
                    messages.append({"role": "tool", "name": call.name or "",
                                     "content": f"Error: {call.message}"})
            invalid += any(not isinstance(call, ToolCall) for call in calls)
            continue
        match = INTEGER.fullmatch(text)
        if match is None:
            invalid += 1
            messages.append({"role": "user", "content": INVALID})
            continue
        right = int(match.group(1)) == task["answer"]
        return {"success": float(right), "invalid": -invalid_penalty * invalid}
    return {"success": 0.0, "invalid": -invalid_penalty * invalid}
