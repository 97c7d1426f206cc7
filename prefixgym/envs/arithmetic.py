"""Arithmetic: evaluate a multi-step integer expression, with a calculator tool.

This module knows text only.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable

from prefixgym.envs.base import AgentEnv, Outcome, share
from prefixgym.prompting.tools import Tool, format_tool_call

_INT_RE = re.compile(r"\s*([+-]?\d{1,30})\s*\.?\s*")
_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % and parentheses.

    Args:
        expression: The expression, for example "(3 + 4) * 5".
    """
    if len(expression) > 500:
        raise ValueError("expression longer than 500 characters")
    value = _evaluate(ast.parse(expression, mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value  # type: ignore[return-value]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if max(abs(left), abs(right)) > 10**12:
            raise ValueError("numbers too large")
        return _BINARY[type(node.op)](left, right)  # type: ignore[no-any-return]
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


class Arithmetic(AgentEnv):
    """Compute the integer value of an expression such as "(7 + 12) * 3 - 5".

    Rules: the agent may call the `calculator` tool (`<tool_call>{"name":
    "calculator", "arguments": {"expression": "..."}}</tool_call>`) any number of
    times; its first reply without a tool call is the answer, one integer. A reply
    that is not an integer is invalid (penalised, the episode goes on).

    Reward: 1.0 for the right answer, 0 for a wrong one (the episode ends either
    way), `-invalid_penalty` per invalid reply or malformed tool call.
    Difficulty: `num_operands` (2..8), `max_value` (operands in 1..max_value),
    `parentheses` (group the first two operands). The expert calls the calculator
    once and then answers.

    `expert_tool_rate` (0..1, default 1) is the share of episodes in which the expert
    uses the calculator; in the others it answers at once, with the right value, as a
    teacher who computes in its head would. A small model that imitates such an expert
    calls the calculator on about that share of episodes and guesses on the rest, so
    GRPO has a choice to learn (docs/training-your-env.md, section 5). Whether the
    expert of an episode uses the tool is drawn from `np_random` after the task, so a
    seed replays it and the task of a seed is the same at every rate.

    `expert_noise` (0..1, default 0) is the share of episodes in which the expert
    mistypes its call: the expression's last operand becomes another value in
    1..max_value, and the expert then answers the tool's (wrong) result, so the
    episode fails. A model that imitates it copies the question into its call but
    puts a random last operand there in about that share of its calls, which GRPO
    can learn away (the same idea as GuessNumber's noisy expert). Drawn after the
    tool-rate draw, and only when above 0.

    `tool_schemas=False` replaces the calculator's JSON schema in the system turn by
    "Tools: calculator(expression)." (with 2 operands a 59-token first prompt, not 243):
    a small model trained from scratch must learn to copy the question's expression
    into its call, and that is learned far sooner in a short context (the tool
    recipe, docs/benchmarks.md).
    """

    system_prompt = (
        "Compute the value of the expression. You may call the calculator tool. "
        "Then reply with the final integer only."
    )

    def __init__(
        self,
        *,
        num_operands: int = 3,
        max_value: int = 20,
        parentheses: bool = True,
        max_turns: int = 4,
        invalid_penalty: float = 0.1,
        expert_tool_rate: float = 1.0,
        expert_noise: float = 0.0,
        tool_schemas: bool = True,
        render_mode: str | None = None,
    ) -> None:
        tool_rate = share("expert_tool_rate", expert_tool_rate)
        noise = share("expert_noise", expert_noise)
        if not 2 <= num_operands <= 8:
            raise ValueError(f"num_operands must be in 2..8, got {num_operands!r}")
        if not 1 <= max_value <= 10**6:
            raise ValueError(f"max_value must be in 1..10**6, got {max_value!r}")
        super().__init__(max_turns=max_turns, invalid_penalty=invalid_penalty,
                         tools=[Tool.from_function(calculator)], tool_schemas=tool_schemas,
                         render_mode=render_mode)
        self.num_operands, self.max_value = num_operands, max_value
        self.parentheses = parentheses
        self.expert_tool_rate, self.expert_noise = tool_rate, noise
        self._expression, self._answer = "1 + 1", 2
        self._expert_expression = self._expression
        self._expert_uses_tool = True

    def _reset_task(self) -> str:
        rng = self.np_random
        numbers = [str(int(rng.integers(1, self.max_value + 1))) for _ in range(self.num_operands)]
        ops = [str(rng.choice(["+", "-", "*"])) for _ in range(self.num_operands - 1)]
        text = numbers[0]
        for i, (op, number) in enumerate(zip(ops, numbers[1:])):
            text = f"{text} {op} {number}"
            if i == 0 and self.parentheses and self.num_operands > 2:
                text = f"({text})"
        self._expression = text
        self._answer = int(calculator(text))
        # drawn only below rate 1, so that runs at the default keep their random stream
        self._expert_uses_tool = (self.expert_tool_rate >= 1.0
                                  or float(self.np_random.random()) < self.expert_tool_rate)
        self._expert_expression = text
        if self.expert_noise > 0 and self.max_value > 1 \
                and float(self.np_random.random()) < self.expert_noise:
            typo = int(rng.integers(1, self.max_value))  # 1..max_value-1, shifted past the
            typo += typo >= int(numbers[-1])             # real one: never the asked value
            head = text[: text.rfind(numbers[-1])]
            self._expert_expression = head + str(typo) + text[len(head) + len(numbers[-1]):]
        return f"What is {text}?"

    def _act(self, text: str) -> Outcome:
        match = _INT_RE.fullmatch(text)
        if match is None:
            return Outcome("Invalid. Reply with the final integer only, or call the "
                           "calculator.", invalid=True)
        if int(match.group(1)) == self._answer:
            return Outcome("Correct!", rewards={"success": 1.0}, done=True, success=True)
        return Outcome(f"Wrong. The answer was {self._answer}.", done=True)

    def expert_action(self) -> str:
        last = self._transcript[-1] if self._transcript else None
        if last is not None and last["role"] == "tool" and last["name"] == "calculator":
            return last["content"]
        if not self._expert_uses_tool:
            return str(self._answer)
        return format_tool_call("calculator", {"expression": self._expert_expression})

    def _leak_probes(self) -> list[str]:
        return [f"= {self._answer}", f"answer is {self._answer}", f"answer was {self._answer}"]
