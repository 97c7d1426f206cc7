"""`prefixgym serve`'s chat calls, token for token: what the history a client sends was.

A chat client resends its whole conversation with every call, as text. Rendering it
through the template again would re-tokenize the replies this server sampled (the seed's
first rule says never): their text can encode to other ids, and a template that renders
history otherwise (reasoning dropped, whitespace moved) would miss the prefix cache. So
the server keeps the calls it answered in `CallTree`s (`prompting.call_tree`), one per
set of template switches (`chat_template_kwargs`), bounded (the oldest replies go
first): a call whose messages extend an earlier call's plus the reply it got continues
that call's tokens and renders only its new messages. A call that extends nothing is
rendered whole, turn by turn, as a new conversation. A `tool_choice` of "required" or a
function ends the prompt with a call's opening in the model's syntax
(`prompting.tool_choice`), and each reply's text is read after it.

A template the conversation builder cannot use turn by turn (one that refuses a message
alone, say) leaves the server as it was: each call rendered whole by the template
(`ChatRequest.render`). Knows chat requests, call trees and the tokenizer; not HTTP.
"""

from __future__ import annotations

import json
import threading
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from prefixgym.prompting.call_tree import (
    CallMessage,
    CallTree,
    Pending,
    call_messages,
    reply_message,
)
from prefixgym.prompting.conversation import make_chat_format
from prefixgym.prompting.tool_choice import forced_opening
from prefixgym.types import JSONObject, SampleResponse


class ChatCall(Protocol):
    """What of a chat request the history reads (`chat.ChatRequest` is one)."""

    chat_template_kwargs: JSONObject | None
    tools: list[JSONObject] | None
    tool_choice: str | JSONObject | None

    @property
    def reads_tool_calls(self) -> bool: ...

    def template_messages(self) -> list[JSONObject]: ...

MAX_REPLIES = 4096
"""Replies each tree keeps (their conversations' tokens are in memory)."""


class ChatHistory:
    """The server's call trees (module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_replies: int = MAX_REPLIES) -> None:
        self.tokenizer = tokenizer
        self.max_replies = max_replies
        self._trees: dict[str, CallTree | None] = {}
        self._lock = threading.Lock()

    def tree(self, req: ChatCall) -> CallTree | None:
        """The tree of the request's template switches; None when its template cannot be
        used turn by turn (ValueError: switches the template does not take)."""
        key = json.dumps(req.chat_template_kwargs or {}, sort_keys=True)
        with self._lock:
            if key not in self._trees:
                self._trees[key] = self._new_tree(req)
            return self._trees[key]

    def _new_tree(self, req: ChatCall) -> CallTree | None:
        try:
            fmt = make_chat_format(self.tokenizer, template_kwargs=req.chat_template_kwargs)
        except ValueError as e:
            if req.chat_template_kwargs and "switches" in str(e):
                raise
            return None
        return CallTree(self.tokenizer, fmt, max_nodes=self.max_replies)

    def begin(self, req: ChatCall) -> Pending | None:
        """The call's prompt through its tree, its forced opening last (None: render it
        whole); ValueError for messages the conversation builder refuses,
        `ToolChoiceError` for a tool choice that cannot be forced."""
        tree = self.tree(req)
        if tree is None:
            return None
        forced = forced_opening(req.tool_choice, req.tools or [], tree.syntax)
        messages = call_messages(req.template_messages())
        return tree.begin(messages, req.tools or [], forced)

    def record(self, req: ChatCall, pending: Pending, response: SampleResponse,
               texts: list[str]) -> list[tuple[CallMessage, str | None]]:
        """Each choice's reply in the tree, keyed by the message its client gets: `texts`
        are the choices' texts as sampled (cut at stop strings), read after the call's
        forced opening; returns each message and its reasoning (none: the text is
        answered as it is)."""
        tree = self.tree(req)
        assert tree is not None
        out: list[tuple[CallMessage, str | None]] = []
        for seq, text in zip(response.sequences, texts):
            message, reasoning = reply_message(pending.forced_text + text, tree.syntax,
                                               req.reads_tool_calls, split_reasoning=False)
            tree.add_reply(pending, seq.tokens, seq.logprobs, seq.stop_reason,
                           lambda _: message)
            out.append((message, reasoning))
        return out
