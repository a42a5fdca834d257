"""HTTP plumbing shared by every route: the bounded JSON body, error handlers, JSON responses."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from ..common.errors import (BodyTooLarge, EmbedfleetError, InvalidJSON,
                      MethodNotAllowed, RouteNotFound,
                      UnsupportedMediaType, clip, error_response,
                      internal_error_response)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None,
                  raw: bool = False) -> Response:
    """``body`` encoded with orjson (numpy arrays included); ``raw``: already bytes."""
    data = body if raw else orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(data, status_code=status, headers=headers, media_type="application/json")


async def read_json_body(request: Request, limit: int) -> Any:
    """The decoded JSON body, enforcing the size limit before and while reading.

    orjson refuses nesting deeper than 1,024 levels (a 400 here); anything shallower reaches
    the request models, whose errors echo values only through ``errors.clip``.
    """
    declared = request.headers.get("content-length", "")
    # ASCII digits only ('²'.isdigit() is true, int('²') raises); 19 digits or more is too
    # large for any limit, and int() of thousands of digits would raise
    if declared.isascii() and declared.isdigit() and (len(declared) > 18
                                                      or int(declared) > limit):
        shown = declared if len(declared) <= 20 else clip(declared, 20)
        raise BodyTooLarge(f"request body of {shown} bytes exceeds the limit of {limit} bytes")
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise UnsupportedMediaType(
            f"content type must be application/json; got {clip(ctype) if ctype else 'none'}")
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
                f"method {clip(request.method)} is not allowed on {clip(request.url.path)}"))
        if exc.status_code == 404:
            return error_response(RouteNotFound(
                f"no route {clip(request.method)} {clip(request.url.path)}"))
        return error_response(EmbedfleetError(str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        return internal_error_response(exc, f"{request.method} {request.url.path}")
