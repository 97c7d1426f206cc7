"""The OpenAI completions request that `prefixgym serve` accepts, and its error shape.

`CompletionRequest` checks types and ranges strictly (a string where a number belongs
is refused, not coerced; a negative token id; text holding a lone surrogate, which
no tokenizer can encode) and turns the request into engine terms: prompt token ids,
`SamplingParams`, and how to present the answer. `json_depth` measures how deep a
body nests before it is parsed, so that a body nested 100,000 deep is refused
instead of overflowing the parser's recursion. Checks that need the model -- token
ids inside the vocabulary, prompt + max_tokens within the context -- are the
engine's, and limits of this server (`max_n`, `max_request_tokens`) are the app's.

Fields beyond OpenAI's are vLLM's names for the same things: `stop_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`, `top_k`, `return_token_ids`,
`ignore_eos` (do not stop at the end-of-turn tokens).
Unknown fields are ignored, as vLLM does; a field sent as null is a field not sent (OpenAI
takes null for every optional field, and its SDK sends an argument given as None). What
the engine cannot do is refused by name, never ignored: a frequency or presence penalty
other than 0, a `logit_bias` that biases something. This module knows nothing of HTTP.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from prefixgym.types import JSONObject, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_LOGPROBS = 20
MAX_JSON_DEPTH = 32
"""How deep a request body may nest (a completion request needs 3 levels)."""

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_OPENERS, _CLOSERS = b"[{", b"]}"
_BRACKET_STEP = bytes.maketrans(_OPENERS + _CLOSERS, b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(set(range(256)) - set(_OPENERS + _CLOSERS))


def json_depth(body: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets inside strings do
    not count); linear in the body, without recursion."""
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    steps = np.frombuffer(brackets.translate(_BRACKET_STEP), dtype=np.int8)  # +1 opens, -1 closes
    return int(np.cumsum(steps, dtype=np.int32).max())


def valid_text(value: str, where: str) -> str:
    """`value`, or ValueError when it holds a lone surrogate (no tokenizer encodes it)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where} holds a lone surrogate ({value[e.start]!r} at character "
                         f"{e.start}); text must be valid Unicode") from None
    return value


class RequestBody(BaseModel):
    """A request body's fields: strict types, unknown fields ignored (as vLLM does), and
    a field sent as null taken as not sent (OpenAI's SDK sends `None` arguments so)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: object) -> object:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class SamplingFields(RequestBody):
    """The fields completions and chat share: the model, how many samples, and how."""

    model: str | None = None
    n: int = Field(default=1, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("this server samples without penalties; send 0 or leave it out")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value and any(value.values()):
            raise ValueError("this server samples without logit biases; send {} or leave it "
                             "out")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        for text in [value] if isinstance(value, str) else value or []:
            valid_text(text, "stop")
        return value

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def reply_text(self, tokenizer: PreTrainedTokenizerBase | None, tokens: list[int],
                   stop_reason: str, keep_stop: bool = False) -> str:
        """A sampled sequence's text, cut before the stop string that ended it (unless
        `keep_stop`: vLLM's `include_stop_str_in_output`)."""
        text = decode_ids(tokenizer, tokens, self.skip_special_tokens)
        return text if keep_stop else self.cut_at_stop(text, stop_reason)

    def cut_at_stop(self, text: str, stop_reason: str) -> str:
        """`text` cut before the first of this request's stop strings, when one ended it."""
        if stop_reason != "stop":
            return text
        hits = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
        return text[: min(hits)] if hits else text

    def engine_params(self, max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams (raises pydantic's ValidationError, a ValueError)."""
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, stop=self.stop_strings, stop_token_ids=self.stop_token_ids or [],
            seed=self.seed,
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(default=16, ge=0)
    logprobs: int | bool | None = None
    echo: bool = False
    stream: bool = False
    include_stop_str_in_output: bool = False

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | bool | None) -> int | bool | None:
        if type(value) is int and not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {value}")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str | list[int] | list[str] | list[list[int]]
                ) -> str | list[int] | list[str] | list[list[int]]:
        items = [value] if isinstance(value, str) else value
        for item in items:
            if isinstance(item, str):
                valid_text(item, "prompt")
            for t in [item] if isinstance(item, int) else item if isinstance(item, list) else []:
                if t < 0:
                    raise ValueError(f"prompt holds the token id {t}; ids are non-negative")
        return value

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, value: bool) -> bool:
        if value:
            raise ValueError("stream=true is not supported by prefixgym serve")
        return value

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None and self.logprobs is not False

    @property
    def prompt_texts(self) -> list[str]:
        """The prompt's text parts (none for token ids)."""
        prompt = self.prompt
        return [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]

    def prompt_ids(self, tokenizer: PreTrainedTokenizerBase | None) -> list[int]:
        """The prompt as token ids: ids as given, text through `tokenizer` (no special tokens)."""
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # a batch of one prompt
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError("prompt is text but this server has no tokenizer; send token ids")
            ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        elif prompt and isinstance(prompt[0], (list, str)):
            raise ValueError(
                f"prompt holds {len(prompt)} prompts; prefixgym serve takes one prompt per "
                "request (use n for several samples)"
            )
        else:
            ids = list(prompt)  # type: ignore[arg-type]
        if not ids:
            raise ValueError("prompt is empty; a prompt needs at least one token")
        return ids

    def sampling_params(self) -> SamplingParams:
        return self.engine_params(self.max_tokens)


def decode_ids(tokenizer: PreTrainedTokenizerBase | None, ids: list[int],
               skip_special: bool) -> str:
    """The text of token ids ("" without a tokenizer)."""
    if tokenizer is None or not ids:
        return ""
    return str(tokenizer.decode(ids, skip_special_tokens=skip_special))


class APIError(Exception):
    """A request this server refuses: its HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: int | None = None) -> JSONObject:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def describe_validation_error(error: ValidationError) -> tuple[str, str | None]:
    """A one-line message naming the first bad field, and that field's name."""
    first = error.errors()[0]
    loc = [str(part) for part in first.get("loc", ())]
    # a union reports each branch (`prompt.str`, `prompt.list[int]`); the field is enough
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "request"
    count = len(error.errors())
    more = f" (and {count - 1} more problem{'s' if count > 2 else ''})" if count > 1 else ""
    value = first.get("input")
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")  # pydantic's
    return f"{where}: {msg} (got {shown}){more}", param
