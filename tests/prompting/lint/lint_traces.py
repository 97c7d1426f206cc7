"""A toy tokenizer and trace builders for the trace linter's tests.

The tokenizer maps characters to their code points, ChatML markers to 300/301, and
merges "ab" into 302 -- so the same text can be encoded in two ways (re-tokenization).
"""

from __future__ import annotations

from typing import Any

from prefixgym.prompting.lint.trace_file import TraceRequest, parse_request

PIECES = {"<|im_start|>": 300, "<|im_end|>": 301, "ab": 302}
IDS = {v: k for k, v in PIECES.items()}


def encode(text: str, merge: bool = True) -> list[int]:
    ids, i = [], 0
    while i < len(text):
        for piece, pid in PIECES.items():
            if text.startswith(piece, i) and (merge or pid != 302):
                ids.append(pid)
                i += len(piece)
                break
        else:
            ids.append(ord(text[i]))
            i += 1
    return ids


def decode(ids: list[int]) -> str:
    return "".join(IDS.get(i, chr(i)) for i in ids)


def msg(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


SYSTEM = msg("system", "You are a careful agent. Tools: lookup(query).")


def prompt(*turns: str, system: str = SYSTEM) -> str:
    return system + "".join(turns) + "<|im_start|>assistant\n"


def line(episode: str, turn: int, prompt_ids: list[int], completion: list[int] | None = None,
         group: str | None = None, **fields: Any) -> dict[str, Any]:
    return {"episode_id": episode, "group_id": group or episode, "turn": turn,
            "prompt_tokens": prompt_ids, "completion_tokens": [completion or []],
            "num_samples": fields.pop("num_samples", 1),
            "include_prompt_logprobs": fields.pop("include_prompt_logprobs", False), **fields}


def requests(lines: list[dict[str, Any]]) -> list[TraceRequest]:
    return [parse_request(obj, f"trace:{i}", i) for i, obj in enumerate(lines, start=1)]


def two_turn_episode(episode: str, user1: str, reply: str, user2: str, *, system: str = SYSTEM,
                     next_system: str | None = None, retokenize: bool = False,
                     drop_first_user: bool = False) -> list[dict[str, Any]]:
    """One episode of two requests; the keyword arguments break it in one way each."""
    first = encode(prompt(msg("user", user1), system=system))
    sampled = encode(reply + "<|im_end|>", merge=False)
    if retokenize or next_system is not None or drop_first_user:
        history = [] if drop_first_user else [msg("user", user1)]
        text = prompt(*history, msg("assistant", reply), msg("user", user2),
                      system=next_system or system)
        second = encode(text)
    else:
        second = first + sampled + encode("\n" + msg("user", user2) + "<|im_start|>assistant\n")
    return [line(episode, 0, first, sampled), line(episode, 1, second, encode("ok<|im_end|>"))]
