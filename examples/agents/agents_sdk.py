"""An agent written with OpenAI's Agents SDK (`pip install openai-agents`), trained as is.

    prefixgym train --agent examples/agents/agents_sdk.py:agent \\
        --tasks examples/agents/arithmetic.jsonl --steps 40

The SDK's default model speaks the Responses API; the endpoint answers it (input items,
function calls and their outputs) and records every call token for token. The program
only points the SDK's client at `base_url`; nothing in the agent changes.
"""

from __future__ import annotations

from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)  # the SDK would send its traces to OpenAI


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * and parentheses."""
    if not set(expression) <= set("0123456789+-*() "):
        return "Error: only integers, + - * and parentheses"
    try:
        return str(eval(expression, {"__builtins__": {}}))  # digits and operators only
    except SyntaxError:
        return "Error: not an expression"


async def agent(base_url: str, api_key: str, model: str, task: dict) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    solver = Agent(name="solver", tools=[calculator],
                   instructions="Compute the value. You may call the calculator. "
                                "Then reply with the final integer only.",
                   model=OpenAIResponsesModel(model=model, openai_client=client))
    result = await Runner.run(solver, task["question"], max_turns=4)
    return float(str(result.final_output).strip() == str(task["answer"]))
