"""Every refusal of an OpenAI-compatible app in OpenAI's shape, `{"error": {...}}`.

`install_error_handlers(app)` turns this package's errors (`APIError`, a body refused by
`bodies.py`, a weight route's `WeightsError`) and starlette's own (an unknown route) into
one JSON line with the status they carry; anything else is a 500 that says only that the
server failed (the exception goes to the log, never to the client). `prefixgym serve`'s
app and the agent gateway both install them. Knows HTTP and the error shape only.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixgym.serving.bodies import BodyError
from prefixgym.serving.protocol import APIError, error_body
from prefixgym.serving.weights import WeightsError

log = logging.getLogger("prefixgym.serve")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(WeightsError)
    async def _weights_error(_: Request, e: WeightsError) -> JSONResponse:
        return JSONResponse(error_body(e.message, "invalid_request_error", e.param, e.status),
                            e.status)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(error_body(e.message, e.kind, e.param, e.status), e.status)

    @app.exception_handler(BodyError)
    async def _body_error(_: Request, e: BodyError) -> JSONResponse:
        return JSONResponse(error_body(e.message, "invalid_request_error", None, e.status),
                            e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail), "invalid_request_error", None,
                                       e.status_code), e.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return JSONResponse(error_body("the server failed to answer this request (its log has "
                                       "the details)", "internal_error", None, 500), 500)
