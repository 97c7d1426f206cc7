"""CallTree: the chat calls of one agent program's rollout, token for token.

A program over OpenAI's API sends its whole conversation with every call, as text. The
tree turns those calls back into the token sequences the sampler saw, so that what is
trained is what was sampled (the seed's first rule: never re-tokenize history):
  1) a call is its tools and its messages (`CallMessage`, normalized from OpenAI's
     shapes by `call_messages`, both in `call_messages.py`);
  2) `begin(call)` finds the node the call continues: a node is one sampled reply, keyed
     by the messages of the call that asked for it plus the reply message the program
     got back; the longest node whose key starts the call's messages (same tools) wins.
     Its conversation is forked and only the messages after the key are rendered
     (Conversation's append rule: the sampled ids stay as they are). A call that
     continues no node -- the first, or one whose program edited, dropped or reordered
     its history, or changed its tools -- renders all its messages: a new branch, and
     for every branch after the first, the tokens it prefills again and why
     (`Branch`, with the trace rule that names the cause, docs/lint-rules.md);
     A call may force its reply's opening (`forced`: a tool call's start, for a
     `tool_choice` that demands one, `prompting.tool_choice`): those tokens end its
     prompt and are never trained;
  3) `add_reply(pending, ...)` records each sampled reply as a node (the `n` choices of
     one call are siblings), its forced opening before it: the reply's text, and the
     message a later call sends back, is forced + sampled text;
  4) `sequences()` gives what to train: each node no later call continued is the end
     of one sequence (tokens, which were sampled, their logprobs); a choice passed over
     (a sibling of a choice the program went on with) is left out.
The tree is safe to share between threads (a program may send calls in parallel). A
server's tree (`prefixgym serve`'s chat history) is bounded by `max_nodes`: it forgets
its oldest replies first.

Knows messages, tools, tokens and chat formats; nothing of HTTP, samplers or rewards.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from prefixgym.prompting.call_messages import CallMessage, call_messages, reply_message
from prefixgym.prompting.chat_format import ChatFormat, ChatMLFormat
from prefixgym.prompting.conversation import Conversation
from prefixgym.prompting.divergence import common_prefix_len, first_divergence, volatile_kind
from prefixgym.prompting.tool_syntax import ToolCallSyntax, syntax_for_template
from prefixgym.prompting.tools import Tool
from prefixgym.types import JSONObject

__all__ = [  # the messages' names are call_messages.py's, imported from here too
    "FORCED_CALL_MISSED", "Branch", "CallMessage", "CallTree", "Node", "Pending", "Reply",
    "TrainedSequence", "call_messages", "reply_message", "tool_syntax_of",
]

FORCED_CALL_MISSED = "forced_call_missed"
"""A reply's `info` key: its call's opening was forced, and it still wrote no call."""


@dataclass
class Reply:
    """One sampled reply inside a sequence: tokens [start, end) and their logprobs."""

    start: int
    end: int
    logprobs: list[float]
    stop_reason: str
    text: str
    info: JSONObject = field(default_factory=dict)
    """What the caller keeps with the reply (its request's usage, weights version)."""


@dataclass
class Branch:
    """A call that continued no earlier reply: its sequence was rendered anew."""

    call: int
    prompt_tokens: int
    reprefilled_tokens: int
    """Prompt tokens past the longest token prefix it shares with an earlier sequence:
    what the prefix cache could not serve."""
    rule: str
    reason: str

    def line(self) -> str:
        return (f"call {self.call}: {self.rule} {self.reason}; {self.reprefilled_tokens} of "
                f"its {self.prompt_tokens} prompt tokens prefilled again")


@dataclass
class Node:
    conv: Conversation
    replies: list[Reply]
    call: int
    key: tuple[str, ...]
    extended: bool = False


@dataclass
class Pending:
    """A call begun: its conversation up to the generation prompt."""

    call: int
    conv: Conversation
    prompt: list[int]
    keys: tuple[str, ...]
    replies: list[Reply]
    parent: Node | None
    branch: Branch | None
    forced: list[int] = field(default_factory=list)
    """The ids the prompt ends with that the reply was made to begin with (not sampled)."""
    forced_text: str = ""
    """`forced` as text (what the reply's text is read after)."""


@dataclass
class TrainedSequence:
    """One trained sequence: its tokens and, aligned, which were sampled and their logprobs."""

    tokens: list[int]
    sampled_mask: list[bool]
    logprobs: list[float]
    replies: list[Reply]
    extension_ok: bool
    branch: int
    """Which branch of the rollout it ends (0: the one the first call began)."""


class CallTree:
    """The calls of one rollout (see the module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_format: ChatFormat,
                 max_nodes: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.format = chat_format
        self.syntax = tool_syntax_of(chat_format)
        """How the format's replies write tool calls (None: unknown)."""
        self.branches: list[Branch] = []
        self.calls = 0
        self.forced_misses = 0
        """Replies after a forced opening that still wrote no call the syntax reads."""
        self._nodes: list[Node] = []
        self._index: dict[tuple[str, ...], Node] = {}
        self._roots: list[int] = []  # the call each branch began at
        self._lock = threading.Lock()
        self.max_nodes = max_nodes
        """Replies kept at most (a server's tree: the oldest go first); None: all."""

    def begin(self, messages: Sequence[CallMessage], tools: Sequence[JSONObject] = (),
              forced: str = "") -> Pending:
        """2) The call's conversation up to its generation prompt, then the ids of
        `forced` (ValueError: messages a chat format cannot render, or tool calls
        without a known syntax)."""
        if not messages:
            raise ValueError("a call needs at least one message")
        tools_key = json.dumps(list(tools), sort_keys=True, ensure_ascii=False)
        keys = (tools_key, *(m.key for m in messages))
        with self._lock:
            call, self.calls = self.calls, self.calls + 1
            parent = self._match(keys)
        if parent is not None:
            conv, rest, replies = parent.conv.fork(), messages[len(parent.key) - 1:], parent.replies
        else:
            conv, rest, replies = self._new_conversation(messages, tools), messages, []
            if messages[0].role == "system":
                rest = messages[1:]
        for m in rest:
            self._append(conv, m)
        forced_ids = list(self.tokenizer.encode(forced, add_special_tokens=False)
                          ) if forced else []
        prompt = conv.generation_prompt().tokens + forced_ids
        branch = None
        with self._lock:
            if parent is None:
                if self._roots:
                    branch = self._explain(call, keys, prompt)
                    self.branches.append(branch)
                self._roots.append(call)
        return Pending(call, conv, prompt, keys, list(replies), parent, branch, forced_ids,
                       forced)

    def add_reply(self, pending: Pending, tokens: Sequence[int], logprobs: Sequence[float],
                  stop_reason: str, message_of: Callable[[str], CallMessage],
                  info: JSONObject | None = None) -> CallMessage:
        """3) One reply sampled for `pending`, exactly as sampled. `message_of(text)` is the
        message the program gets back for the reply's text; later calls that send it
        back continue this reply. Returns that message."""
        conv = pending.conv.fork()
        conv.add_sampled(list(tokens), stop_reason="stop" if stop_reason == "stop" else
                         "length" if stop_reason == "length" else None, forced=pending.forced)
        seg = next(s for s in reversed(conv.segments) if s.kind == "reply")
        text = conv.last_reply_text
        message = message_of(text)
        missed = bool(pending.forced) and not message.tool_calls
        reply = Reply(seg.start, seg.end, [float(x) for x in logprobs], stop_reason, text,
                      {**(info or {}), **({FORCED_CALL_MISSED: True} if missed else {})})
        node = Node(conv, [*pending.replies, reply], pending.call, (*pending.keys, message.key))
        with self._lock:
            self._nodes.append(node)
            self._index[node.key] = node
            if pending.parent is not None:  # (a call that failed continues nothing)
                pending.parent.extended = True
            self.forced_misses += missed
            if self.max_nodes is not None and len(self._nodes) > self.max_nodes:
                self._forget(len(self._nodes) - self.max_nodes)
        return message

    def _forget(self, count: int) -> None:
        """Drop the `count` oldest replies (a later call that extended one renders its
        history anew: a branch, counted as such)."""
        for node in self._nodes[:count]:
            if self._index.get(node.key) is node:
                del self._index[node.key]
        del self._nodes[:count]
        keep = self.max_nodes or 0  # (a server's tree reports no branches: keep it bounded)
        del self.branches[:max(0, len(self.branches) - keep)]
        del self._roots[:max(0, len(self._roots) - keep)]

    def sequences(self) -> list[TrainedSequence]:
        """4) Each node no call continued, in the order sampled, as a trained sequence;
        choices passed over for a sibling the program continued are left out."""
        with self._lock:
            nodes = list(self._nodes)
        continued_calls = {n.call for n in nodes if n.extended}
        out = []
        for node in nodes:
            if node.extended or node.call in continued_calls:
                continue
            tokens = node.conv.tokens
            mask, logprobs = [False] * len(tokens), [0.0] * len(tokens)
            for r in node.replies:
                mask[r.start:r.end] = [True] * (r.end - r.start)
                logprobs[r.start:r.end] = r.logprobs
            branch = sum(1 for c in self._roots if c <= node.call) - 1
            out.append(TrainedSequence(tokens, mask, logprobs, list(node.replies),
                                 node.conv.extension_ok, branch))
        return out

    # -- internals ------------------------------------------------------------------

    def _match(self, keys: tuple[str, ...]) -> Node | None:
        """The node whose key is the longest proper prefix of `keys` (same tools)."""
        for end in range(len(keys) - 1, 1, -1):
            node = self._index.get(keys[:end])
            if node is not None:
                return node
        return None

    def _new_conversation(self, messages: Sequence[CallMessage],
                          tools: Sequence[JSONObject]) -> Conversation:
        system = messages[0].content if messages[0].role == "system" else None
        specs = [Tool.from_openai(t, f"tools[{i}]") for i, t in enumerate(tools)]
        return Conversation(self.tokenizer, system=system, tools=specs, chat_format=self.format)

    def _append(self, conv: Conversation, m: CallMessage) -> None:
        if m.role == "assistant":
            text = m.content
            if m.tool_calls:
                if self.syntax is None:
                    raise ValueError("an assistant message has tool_calls, but this model's "
                                     "tool-call syntax is not known")
                text = self.syntax.format(m.content, m.tool_calls)
            conv.add_assistant(text)
        elif m.role == "tool":
            conv.add_tool_result(m.name or "", m.content)
        else:
            conv.add_message(m.role, m.content)

    def _explain(self, call: int, keys: tuple[str, ...], prompt: list[int]) -> Branch:
        """Why a call continued no node, and what it costs: against the node that shares
        most of its messages, and the earlier sequence that shares most of its tokens."""
        shared = max((common_prefix_len(n.conv.tokens, prompt) for n in self._nodes), default=0)
        reprefilled = len(prompt) - shared
        best = max(self._nodes, key=lambda n: common_prefix_len(n.key, keys), default=None)
        if best is None:
            return Branch(call, len(prompt), reprefilled, "PG204", "no earlier call was answered")
        at = common_prefix_len(best.key, keys)
        rule, reason = _edit_reason(best.key, keys, at)
        if rule == "PG204":
            left = str(self.tokenizer.decode(best.conv.tokens))
            right = str(self.tokenizer.decode(prompt))
            char_at = first_divergence(left, right)
            kind = None if char_at is None else volatile_kind(left, right, char_at)
            if kind is not None:
                rule, reason = "PG203", f"volatile content ({kind}) changed in the history"
        return Branch(call, len(prompt), reprefilled, rule, reason)


def _edit_reason(earlier: tuple[str, ...], later: tuple[str, ...], at: int) -> tuple[str, str]:
    """(trace rule, reason) for a call whose keys leave an earlier node's keys at `at`
    (index 0 is the tools, 1 the first message)."""
    if at == 0:
        return "PG202", "the tools changed"
    message = at - 1
    old = json.loads(earlier[at]) if at < len(earlier) else None
    new = json.loads(later[at]) if at < len(later) else None
    if old is None or new is None:
        return "PG204", f"the history was cut after message {message}"
    if message == 0 and "system" in (old[0], new[0]):
        return "PG202", "the system prompt changed"
    if old[0] == "assistant" and at == len(earlier) - 1:
        what = "its reasoning stripped" if "<think>" in old[1] and "<think>" not in new[1] \
            else "edited"
        return "PG204", f"the reply to call sent back {what} (message {message})"
    if at + 1 < len(later) and later[at + 1] == earlier[at]:
        return "PG204", f"a message was inserted before message {message}"
    if at + 1 < len(earlier) and earlier[at + 1] == later[at]:
        return "PG204", f"message {message} ({old[0]}) was dropped"
    if old[0] == new[0]:
        return "PG204", f"message {message} ({old[0]}) was edited"
    return "PG204", f"the history was rewritten from message {message}"


def tool_syntax_of(chat_format: ChatFormat) -> ToolCallSyntax | None:
    """The tool-call syntax of a chat format: the built-in format's, or the one its own
    template's text implies (the template it renders with, which may not be the
    tokenizer's); None when it is unknown."""
    if isinstance(chat_format, ChatMLFormat):
        return syntax_for_template(None, builtin=True)
    return syntax_for_template(getattr(chat_format, "chat_template", None))
