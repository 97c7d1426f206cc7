"""What a request is refused for before the engine sees it: the key, the model, the limits.

`bearer_check(api_key)` is the check every route but /health makes, on `prefixgym
serve`'s app and on the agent gateway: `Authorization: Bearer KEY`, else 401 (no key
configured: nothing to check). `RequestLimits` are `prefixgym serve`'s limits, which the
completions and chat routes share: an unknown model is a 404; `n` above `max_n`, and a
text that cannot fit in `max_request_tokens` (checked on its characters, before the
tokenizer spends time on it), are 400s. Every refusal is an `APIError`. Knows the
request's headers and sizes; nothing of tokens' meaning or of the engine.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request
from transformers import PreTrainedTokenizerBase

from prefixgym.serving.config import ServeConfig
from prefixgym.serving.protocol import APIError
from prefixgym.serving.weights import ServedWeights


def bearer_check(api_key: str | None) -> Callable[[Request], None]:
    """`authorize(request)`: APIError 401 unless the request carries `api_key` as its
    bearer token (compared in constant time); without a key, every request passes."""
    expected = f"Bearer {api_key}".encode() if api_key else None

    def authorize(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer KEY'",
                           None, "authentication_error")

    return authorize


@dataclass(frozen=True)
class RequestLimits:
    max_n: int
    """Choices per request at most."""
    max_request_tokens: int
    """Prompt and sampled tokens per request at most (the model's context at most)."""
    max_prompt_chars: int
    """Characters of prompt text at most: more cannot tokenize into `max_request_tokens`."""
    max_body_bytes: int
    """A request body's bytes at most."""

    @classmethod
    def of(cls, config: ServeConfig, max_seq_len: int,
           tokenizer: PreTrainedTokenizerBase | None) -> RequestLimits:
        """`config`'s limits for a model of `max_seq_len` tokens and its `tokenizer`."""
        max_request_tokens = min(config.max_request_tokens or max_seq_len, max_seq_len)
        return cls(config.max_n, max_request_tokens,
                   max_request_tokens * _longest_token(tokenizer), config.max_body_bytes)

    def check_model_and_n(self, weights: ServedWeights, model: str | None, n: int) -> None:
        """404 for a model this server does not serve; 400 for `n` above `max_n`."""
        if not weights.serves(model):
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                                f"{weights.model_name!r}", "model", "not_found_error")
        if n > self.max_n:
            raise APIError(400, f"n = {n} exceeds this server's limit of {self.max_n}", "n")

    def check_chars(self, chars: int, what: str, param: str) -> None:
        """400 (naming `param`) for `what`, `chars` characters long, when that cannot fit."""
        if chars > self.max_prompt_chars:
            raise APIError(400, f"{what} of {chars:,} characters cannot fit in this server's "
                                f"limit of {self.max_request_tokens} tokens per request", param)


def _longest_token(tokenizer: PreTrainedTokenizerBase | None) -> int:
    """The most characters one token stands for: a text of more than N times this
    cannot tokenize into N tokens (a tokenizer whose normalizer deletes characters
    aside), so it is refused before the tokenizer spends seconds on it."""
    if tokenizer is None:
        return 1
    return max((len(t) for t in tokenizer.get_vocab()), default=1)
