"""KeyValueLookup: answer a two-hop question about a hidden key-value store.

This module knows text only.
"""

from __future__ import annotations

import string

from prefixgym.envs.base import AgentEnv, Outcome
from prefixgym.prompting.tools import Tool, format_tool_call

_ALPHABET = string.ascii_lowercase + string.digits


class KeyValueLookup(AgentEnv):
    """A store of `num_keys` random keys; the value under the asked key is another
    key, and the answer is the value stored under that one.

    Rules: the store is visible only through the `lookup` tool
    (`<tool_call>{"name": "lookup", "arguments": {"key": "..."}}</tool_call>`).
    The first reply without a tool call is the answer: the final value, as is.
    An empty reply is invalid (penalised, the episode goes on).

    Reward: 1.0 for the final value; `partial_credit` for answering the middle key
    (one hop done); 0 for anything else; the episode ends on any answer.
    `-invalid_penalty` per invalid reply or malformed tool call. Difficulty:
    `num_keys` (distractor keys, some of which also point at keys), `key_length`.
    The expert looks up twice, then answers. `tool_schemas=False`: the system turn
    names the tool ("Tools: lookup(key).") instead of carrying its JSON schema.
    """

    system_prompt = (
        "Answer the question about the key-value store. Use the lookup tool to read it. "
        "Then reply with the final value only."
    )

    def __init__(
        self,
        *,
        num_keys: int = 8,
        key_length: int = 6,
        max_turns: int = 6,
        partial_credit: float = 0.2,
        invalid_penalty: float = 0.1,
        tool_schemas: bool = True,
        render_mode: str | None = None,
    ) -> None:
        if not 3 <= num_keys <= 1000:
            raise ValueError(f"num_keys must be in 3..1000, got {num_keys!r}")
        if not 4 <= key_length <= 32:
            raise ValueError(f"key_length must be in 4..32, got {key_length!r}")
        lookup = Tool.from_function(self.lookup, name="lookup")
        super().__init__(max_turns=max_turns, invalid_penalty=invalid_penalty,
                         tools=[lookup], tool_schemas=tool_schemas, render_mode=render_mode)
        self.num_keys, self.key_length = num_keys, key_length
        self.partial_credit = float(partial_credit)
        self._store: dict[str, str] = {}
        self._question_key = self._middle_key = self._answer = ""

    def lookup(self, key: str) -> str:
        """Read the value stored under a key.

        Args:
            key: The key to look up.
        """
        return self._store.get(key.strip(), f"No key {key.strip()!r} in the store.")

    def _reset_task(self) -> str:
        words: list[str] = []
        while len(words) < 2 * self.num_keys:
            chars = self.np_random.choice(list(_ALPHABET), size=self.key_length)
            word = "".join(str(ch) for ch in chars)
            if word not in words:
                words.append(word)
        keys, values = words[: self.num_keys], words[self.num_keys :]
        # keys[0] -> keys[1] -> values[1]; a distractor also points at a key
        self._store = {key: value for key, value in zip(keys, values)}
        self._store[keys[0]] = keys[1]
        self._store[keys[2]] = keys[int(self.np_random.integers(3, self.num_keys))
                                    if self.num_keys > 3 else 0]
        self._question_key, self._middle_key, self._answer = keys[0], keys[1], values[1]
        return (f"The store has {self.num_keys} keys. The value under key "
                f"{self._question_key} is another key. What value is stored under that key?")

    def _act(self, text: str) -> Outcome:
        answer = text.strip()
        if not answer:
            return Outcome("Invalid. Reply with the final value, or call lookup.",
                           invalid=True)
        if answer == self._answer:
            return Outcome("Correct!", rewards={"success": 1.0}, done=True, success=True)
        if answer == self._middle_key:
            return Outcome("Only one hop: that is the middle key.",
                           rewards={"partial": self.partial_credit}, done=True)
        return Outcome("Wrong.", done=True)

    def expert_action(self) -> str:
        results = [m["content"] for m in self._transcript if m["role"] == "tool"]
        if not results:
            return format_tool_call("lookup", {"key": self._question_key})
        if len(results) == 1:
            return format_tool_call("lookup", {"key": results[0]})
        return results[-1]

    def _leak_probes(self) -> list[str]:
        return [self._answer, self._middle_key]
