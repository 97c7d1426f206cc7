"""A request's JSON body, read the same way on every route of `prefixgym serve`.

  1) the body must be labelled JSON: `Content-Type: application/json` (parameters
     such as `charset=utf-8` aside) or a `+json` type; anything else, or no label, is
     415 before a byte is read;
  2) at most `limit` bytes (413, by the declared Content-Length first);
  3) UTF-8 text (JSON's encoding between systems, RFC 8259) holding one JSON value
     nested at most `MAX_JSON_DEPTH` deep, and an object: otherwise 400 "request
     body is not valid JSON: ..." with the reason in words (never a codec's name
     from the guess `json.loads` makes at other encodings).

Errors are `BodyError`s (status, one-line message); each route turns them into its
own error shape. Parsing is synchronous, for a worker thread when bodies are large.
"""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from prefixgym.serving.protocol import (
    MAX_JSON_DEPTH,
    APIError,
    describe_validation_error,
    json_depth,
)
from prefixgym.types import JSONObject

__all__ = ["BodyError", "check_content_type", "parse_json_object", "read_body"]


class BodyError(Exception):
    """A request body that cannot be read as JSON: HTTP `status`, one-line `message`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def check_content_type(request: Request) -> None:
    """BodyError 415 unless the request says its body is JSON."""
    given = request.headers.get("content-type")
    media = (given or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/")
                                       and media.endswith("+json")):
        return
    said = f"Content-Type {given[:80]!r}" if given else "no Content-Type"
    raise BodyError(415, f"request body must be JSON sent with Content-Type: "
                         f"application/json; got {said}")


async def read_body(request: Request, limit: int) -> bytes:
    """The body of a request labelled JSON, at most `limit` bytes (BodyError 415, 413)."""
    check_content_type(request)
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BodyError(400, f"Content-Length {declared[:40]!r} is not a number")
        if int(declared) > limit:
            raise BodyError(413, f"request body of {declared} bytes exceeds the limit of "
                                 f"{limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json_object(body: bytes) -> JSONObject:
    """The JSON object `body` holds; BodyError 400 saying why it is not one."""
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise BodyError(400, f"request body nests {depth} levels deep; the limit is "
                             f"{MAX_JSON_DEPTH}")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"request body is not valid JSON: it is not UTF-8 text (byte "
                             f"0x{body[e.start]:02x} at offset {e.start})") from None
    if "\x00" in text:  # JSON escapes every control character; UTF-16 puts NULs in ASCII
        raise BodyError(400, f"request body is not valid JSON: it is not UTF-8 text (a NUL "
                             f"byte at offset {body.index(0)}: UTF-16?)")
    if not text.strip():
        raise BodyError(400, "request body is not valid JSON: it is empty")
    try:
        payload = json.loads(text)
    except ValueError as e:  # JSONDecodeError; an int of 5000 digits
        raise BodyError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(payload, dict):
        raise BodyError(400, f"request body must be a JSON object, got "
                             f"{type(payload).__name__}")
    return payload


RequestT = TypeVar("RequestT", bound=BaseModel)


def parse_request(model: type[RequestT], body: bytes | JSONObject) -> RequestT:
    """A request of `model` from its JSON body (bytes as read, or parsed); APIError 400
    naming the first bad field."""
    try:
        return model.model_validate(parse_json_object(body) if isinstance(body, bytes) else body)
    except ValidationError as e:
        raise APIError(400, *describe_validation_error(e)) from None
