"""The smallest agent program: one question, one call with the `openai` client, a reward.

    prefixgym train --agent examples/agents/plain.py:agent \\
        --tasks examples/agents/arithmetic.jsonl --steps 40

`prefixgym train` calls `agent` once per rollout with a base URL of its own; what the
model answers there is sampled by the model being trained and recorded token for token.
"""

from __future__ import annotations

from openai import DefaultHttpxClient, OpenAI

HTTP = DefaultHttpxClient()
"""One HTTP client for every rollout (a new one builds an SSL context: ~10 ms of CPU)."""


def agent(base_url: str, api_key: str, model: str, task: dict) -> float:
    client = OpenAI(base_url=base_url, api_key=api_key, http_client=HTTP)
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Reply with the final integer only."},
                  {"role": "user", "content": task["question"]}])
    return float((reply.choices[0].message.content or "").strip() == str(task["answer"]))
