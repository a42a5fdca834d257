"""HTTP plumbing shared by every route: the bounded JSON body, error handlers, JSON responses."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from embedfleet.deployments.errors import (BodyTooLarge, EmbedfleetError, InvalidJSON,
                                           MethodNotAllowed, RouteNotFound,
                                           UnsupportedMediaType, error_response,
                                           internal_error_response)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None,
                  raw: bool = False) -> Response:
    """``body`` encoded with orjson (numpy arrays included); ``raw``: already bytes."""
    data = body if raw else orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(data, status_code=status, headers=headers, media_type="application/json")


async def read_json_body(request: Request, limit: int) -> Any:
    """The decoded JSON body, enforcing the size limit before and while reading."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise UnsupportedMediaType(
            f"content type must be application/json; got {ctype or 'none'}")
    chunks, size = [], 0
    async for chunk in request.stream():  # a chunked body has no declared length: count it
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body:
        raise InvalidJSON("request body is empty; expected a JSON object")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as err:
        raise InvalidJSON(f"request body is not valid JSON: {err}") from None


def install_error_handlers(app: FastAPI) -> None:
    """Every failure leaves as the one error body (``errors.error_response``); an unexpected
    exception is a logged 500, never a 4xx."""

    @app.exception_handler(EmbedfleetError)
    async def _embedfleet_error(_: Request, exc: EmbedfleetError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:
            return error_response(MethodNotAllowed(
                f"method {request.method} is not allowed on {request.url.path}"))
        if exc.status_code == 404:
            return error_response(RouteNotFound(f"no route {request.method} {request.url.path}"))
        return error_response(EmbedfleetError(str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        return internal_error_response(exc, f"{request.method} {request.url.path}")
