"""Build a multi-turn conversation with a tool at the token level, and watch the cache hit.

Each turn: ask the Conversation for the generation prompt, sample a reply from the
built-in "tiny" model, append the sampled ids unchanged, answer with a tool result
(or a user message), repeat. Because every prompt extends the previous prompt plus
the sampled tokens, the sampler serves that whole part from its prefix cache and
prefills only the new message: the "cached" column grows turn by turn.

The tiny model is untrained, so its replies are noise; when a reply holds no valid
`<tool_call>`, the example makes the lookup call on its behalf so that a tool result
still follows.

Run: python examples/conversation_cache.py [--turns N]
"""

from __future__ import annotations

import argparse

import prefixgym as pg
from prefixgym.prompting import Conversation
from prefixgym.prompting.tools import ToolCall, parse_tool_calls, tool

STORE = {"alice": "42", "bob": "7", "carol": "1999"}


@tool
def lookup(key: str) -> str:
    """Look up the value stored under a key.

    Args:
        key: The key to look up, e.g. "alice".
    """
    return STORE.get(key, f"error: no key {key!r}")


def main(turns: int = 4, max_tokens: int = 24) -> list[dict[str, int]]:
    service = pg.LocalService(model="tiny", seed=0)
    sampler = service.create_sampling_client()
    conv = Conversation(service.tokenizer, tools=[lookup],
                        system="You answer questions about a key-value store. Use lookup.")
    conv.add_user("What is stored under alice?")
    rows = []
    print(f"fixed prefix: {len(conv.fixed_prefix)} tokens")
    print(f"{'turn':>4} {'prompt':>6} {'cached':>6} {'computed':>8} {'sampled':>7}  reply")
    for turn in range(turns):
        prompt = conv.generation_prompt()
        params = pg.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=turn,
                                   stop=["</tool_call>"], stop_token_ids=conv.stop_token_ids)
        response = sampler.sample(prompt, num_samples=1, sampling_params=params).result()
        seq = response.sequences[0]
        conv.add_sampled(seq.tokens, stop_reason=seq.stop_reason)
        usage = response.usage
        rows.append({"turn": turn, "prompt": prompt.length,
                     "cached": usage.prefill_cached_tokens,
                     "computed": usage.prefill_computed_tokens,
                     "sampled": usage.sampled_tokens})
        reply = conv.last_reply_text
        print(f"{turn:>4} {prompt.length:>6} {usage.prefill_cached_tokens:>6} "
              f"{usage.prefill_computed_tokens:>8} {usage.sampled_tokens:>7}  {reply[:40]!r}")
        calls = [c for c in parse_tool_calls(reply, [lookup]) if isinstance(c, ToolCall)]
        call = calls[0] if calls else ToolCall(name="lookup", arguments={"key": "alice"})
        conv.add_tool_result(call.name, lookup.call(call.arguments))
    assert conv.extension_ok, f"a prompt broke from the last one at {conv.first_divergence}"
    total = service.usage()
    print(f"total: cached {total.prefill_cached_tokens} / prefill {total.prefill_tokens} "
          f"prompt tokens ({total.cache_hit_rate:.0%} served from the prefix cache)")
    service.close()
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=4, help="assistant turns to sample")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per reply at most")
    args = parser.parse_args()
    main(args.turns, args.max_tokens)
