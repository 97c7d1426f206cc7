"""Lint chat templates and a rollout trace for prefix-cache friendliness.

1) Probe two chat templates: an append-only ChatML one, and one that strips the
   `<think>` block of earlier turns (PG101), as many reasoning-model templates do.
2) Build the same two-turn episode twice with the built-in tokenizer: once the
   cache-friendly way (a `Conversation` that appends the sampled ids), once the
   naive way (decode the history to text and encode it again), write both as a
   rollout trace, and replay it: the naive episode gets PG201 (re-tokenized
   history) and a lower predicted hit rate.

The same checks on the command line:
    prefixgym lint template examples/lint/strips_think.jinja --eos-token '<|im_end|>'
    prefixgym lint trace OUT/trace.jsonl --block-size 4

Run: python examples/lint_template_and_trace.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from prefixgym.cli.lint import main as lint_main
from prefixgym.prompting import Conversation
from prefixgym.prompting.lint.report import render_text
from prefixgym.prompting.lint.source import load_template
from prefixgym.prompting.templates.append_only import probe_template
from prefixgym.prompting.tokenizer import load_tokenizer

HERE = Path(__file__).parent / "lint"
SYSTEM = "You play a guessing game. Reply with one integer."
REPLIES = ["Let me think: the middle of 1 and 16 is 8, so 8", "Then 12"]
USERS = ["Guess a number between 1 and 16.", "Higher.", "Lower."]


def lint_templates() -> None:
    for name in ("chatml.jinja", "strips_think.jinja"):
        source = load_template(HERE / name, eos_token="<|im_end|>")
        report = probe_template(source.template, source.bos_token, source.eos_token,
                                origin=source.origin)
        print(render_text(report))
        print()


def episode_requests(tokenizer, episode_id: str, naive: bool) -> list[dict]:
    """The sampling requests of one episode, built from the sampled ids or (naive) from text."""
    conv = Conversation(tokenizer, system=SYSTEM)
    conv.add_user(USERS[0])
    requests = []
    for turn, reply in enumerate(REPLIES):
        prompt = conv.generation_prompt().to_ints()
        if naive and turn > 0:  # decode everything and encode it again
            prompt = tokenizer.encode(tokenizer.decode(prompt), add_special_tokens=False)
        # as if sampled: one id per character, which the tokenizer would merge
        sampled = [i for ch in reply for i in tokenizer.encode(ch, add_special_tokens=False)]
        sampled.append(conv.format.end_of_turn_token_id)  # the stop token ends the sample
        requests.append({"episode_id": episode_id, "group_id": episode_id, "turn": turn,
                         "prompt_tokens": prompt, "completion_tokens": [sampled],
                         "num_samples": 1, "include_prompt_logprobs": False})
        conv.add_sampled(sampled, stop_reason="stop")
        conv.add_user(USERS[turn + 1])
    return requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="where to write trace.jsonl (default: a temp dir)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="prefixgym-lint-"))
    out.mkdir(parents=True, exist_ok=True)

    # 1) templates
    lint_templates()

    # 2) a trace with one cache-friendly and one naive episode
    tokenizer = load_tokenizer("builtin")
    lines = episode_requests(tokenizer, "appends-ids", naive=False)
    lines += episode_requests(tokenizer, "re-encodes-text", naive=True)
    trace = out / "trace.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    code = lint_main(["trace", str(trace), "--block-size", "4"])
    print(f"\nprefixgym lint trace exited with {code} (1 = an error found)")


if __name__ == "__main__":
    main()
