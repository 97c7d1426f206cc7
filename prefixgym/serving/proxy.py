"""RecordingProxy: the agent gateway in front of another OpenAI-compatible server.

`prefixgym proxy --upstream URL` serves the gateway's routes (chat completions,
responses, models) in auto-open mode: each session key (`/rollouts/{key}/v1`, or plain
`/v1` as "default") gets a `CallTree` on its first call, and every call is sampled by the
upstream through token ids (`OpenAISamplingClient`), so the same agent program records
the same token-faithful sequences whether it samples from the trainer or from a vLLM.

A session ends with `POST /rollouts/{key}/close` (`/v1/close`), or when the proxy stops;
then one JSON line per trained sequence of its tree is appended to the record file:
  {"session", "sequence", "branch", "tokens", "sampled_mask", "logprobs",
   "turns": [{"reply_start", "reply_end", "stop_reason"}], "branch_notes"}
`sampled_mask` marks the tokens the upstream sampled, and `logprobs` holds theirs (0
elsewhere); `branch_notes` are the session's branches (`Branch.line`), the same on each
of its lines. A reply two sequences share (sibling choices of an `n` > 1 call that the
program left both unanswered) is marked in both.

Knows the gateway, call trees and files; not flags, tokenizers or which server is behind.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

from prefixgym.prompting.call_tree import CallTree
from prefixgym.protocols import SamplingClient
from prefixgym.serving.agent_gateway import AgentGateway, AutoOpen
from prefixgym.serving.agent_session import RolloutSession, SamplingDefaults
from prefixgym.types import JSONObject


def sequence_records(key: str, tree: CallTree) -> list[JSONObject]:
    """One record per trained sequence of a session's tree (the module docstring)."""
    notes = [b.line() for b in tree.branches]
    return [{"session": key, "sequence": i, "branch": seq.branch, "tokens": seq.tokens,
             "sampled_mask": seq.sampled_mask, "logprobs": seq.logprobs,
             "turns": [{"reply_start": r.start, "reply_end": r.end,
                        "stop_reason": r.stop_reason} for r in seq.replies],
             "branch_notes": notes}
            for i, seq in enumerate(tree.sequences())]


class RecordingProxy:
    """A gateway whose sessions open on first use and are recorded to `record` as they
    end (the module docstring)."""

    def __init__(self, sampler: SamplingClient, model: str, make_tree: Callable[[], CallTree],
                 record: str | Path, defaults: SamplingDefaults | None = None,
                 api_key: str | None = None, host: str = "127.0.0.1") -> None:
        self.record = Path(record)
        self.recorded = 0
        """Sequences written so far."""
        self._write_lock = threading.Lock()
        self.gateway = AgentGateway(model, defaults, api_key, host,
                                    AutoOpen(make_tree, sampler, self.write))

    def start(self, port: int = 0) -> str:
        """Serve on `port` (0: a free one), in a thread; returns the base URL."""
        self.gateway.start(port)
        return self.gateway.url

    def stop(self) -> int:
        """Stop serving and record every session still open; the sequences that makes."""
        self.gateway.stop()
        return sum(self.write(key, session) for key, session in self.gateway.take_all().items())

    def write(self, key: str, session: RolloutSession) -> int:
        """Append a session's records to the record file (all at once); how many."""
        records = sequence_records(key, session.tree)
        if not records:
            return 0
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        with self._write_lock:
            self.record.parent.mkdir(parents=True, exist_ok=True)
            with self.record.open("a", encoding="utf-8") as f:
                f.write(text)
            self.recorded += len(records)
        return len(records)
