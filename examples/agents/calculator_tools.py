"""An agent with a tool, over several turns: OpenAI's `tools` field and `tool_calls`.

    prefixgym train --agent examples/agents/calculator_tools.py:agent \\
        --tasks examples/agents/arithmetic.jsonl --steps 40

The program offers a calculator as a function tool; the endpoint renders its schema
into the system turn in the model's own chat format, parses the calls the model writes
into `tool_calls`, and continues the conversation token for token when the program
sends the results back (docs/agents.md).
"""

from __future__ import annotations

import json

from openai import DefaultHttpxClient, OpenAI

CALCULATOR = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression with + - * and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}

HTTP = DefaultHttpxClient()
"""One HTTP client for every rollout (a new one builds an SSL context: ~10 ms of CPU)."""


def calculate(expression: str) -> str:
    if not set(expression) <= set("0123456789+-*() "):
        return "Error: only integers, + - * and parentheses"
    try:
        return str(eval(expression, {"__builtins__": {}}))  # digits and operators only
    except SyntaxError:
        return "Error: not an expression"


def agent(base_url: str, api_key: str, model: str, task: dict, max_turns: int = 3) -> float:
    client = OpenAI(base_url=base_url, api_key=api_key, http_client=HTTP)
    messages = [{"role": "system", "content": "Compute the value. You may call the calculator. "
                                              "Then reply with the final integer only."},
                {"role": "user", "content": task["question"]}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages,
                                               tools=[CALCULATOR])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float((message.content or "").strip() == str(task["answer"]))
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments or "{}")
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculate(str(arguments.get("expression", "")))})
    return 0.0
