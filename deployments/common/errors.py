"""Typed errors and the one mapping from them to HTTP statuses and OpenAI-style error bodies.

Every client-visible failure is an ``EmbedfleetError`` subclass carrying its status, OpenAI error
``type`` and ``code``. Handlers raise them; ``error_response`` renders them; nothing else builds an
error body. A bare ``ValueError`` is never turned into a 4xx: an unexpected exception is an internal
error (500) and is logged, so bugs never masquerade as client mistakes.

The errors cross Ray process boundaries (engine replica -> router), so they pickle by their
constructor arguments.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import orjson
from starlette.responses import Response

logger = logging.getLogger("embedfleet.errors")


class EmbedfleetError(Exception):
    status: ClassVar[int] = 400
    type: ClassVar[str] = "invalid_request_error"
    code: ClassVar[str] = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        return (_rebuild, (type(self), self.message, self.param, self.retry_after_s))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, int(round(self.retry_after_s))))}


def _rebuild(cls, message, param, retry_after_s):
    return cls(message, param=param, retry_after_s=retry_after_s)


# -- 4xx: the client can fix these -----------------------------------------------------------
class InvalidJSON(EmbedfleetError):
    status, code = 400, "invalid_json"


class RequestValidation(EmbedfleetError):
    """The body parsed but does not fit the API's request schema."""

    status, code = 422, "invalid_value"


class TooManyInputs(EmbedfleetError):
    status, code = 422, "too_many_inputs"


class UnsupportedParameter(EmbedfleetError):
    """A valid parameter this model cannot honour (e.g. ``dimensions`` on a non-Matryoshka model)."""

    status, code = 400, "unsupported_parameter"


class InvalidParameterValue(EmbedfleetError):
    """A value that is out of range for this model (e.g. ``dimensions`` above its vector size)."""

    status, code = 400, "invalid_value"


class InputTooLong(EmbedfleetError):
    status, code = 400, "context_length_exceeded"


class InvalidTokenId(EmbedfleetError):
    status, code = 400, "invalid_token_id"


class ModelNotFound(EmbedfleetError):
    status, code = 404, "model_not_found"


class RouteNotFound(EmbedfleetError):
    status, code = 404, "not_found"


class MethodNotAllowed(EmbedfleetError):
    status, code = 405, "method_not_allowed"


class BodyTooLarge(EmbedfleetError):
    status, code = 413, "request_too_large"


class RequestTooLarge(EmbedfleetError):
    """The request's work is past a per-request bound (``limits``: characters, tokens); the
    message names the limit and the value."""

    status, code = 413, "request_limit_exceeded"


class UnsupportedMediaType(EmbedfleetError):
    status, code = 415, "unsupported_media_type"


class Unauthorized(EmbedfleetError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class LaneNotAllowed(EmbedfleetError):
    """The API key is limited to another lane (router.api_keys_file ``KEY lane=bulk``)."""
    status, type, code = 403, "permission_error", "lane_not_allowed"


class ModelNotAllowed(EmbedfleetError):
    """The API key is limited to other models (router.api_keys_file ``KEY models=a,b``)."""
    status, type, code = 403, "permission_error", "model_not_allowed"


# -- capacity: retry later -------------------------------------------------------------------

class Overloaded(EmbedfleetError):
    status, type, code = 429, "rate_limit_error", "overloaded"


class NotReady(EmbedfleetError):
    status, type, code = 503, "service_unavailable", "no_ready_replica"


class NoCardEver(NotReady):
    """No replica of the model can ever be placed: every card is held by models at their
    ``min_replicas`` on a cluster that cannot grow. The message names the holders. Its code
    stays NotReady's, the one the API documents for 503 with no replica to serve."""


class EngineUnavailable(EmbedfleetError):
    """The engine (or its replica) died or did not answer in time; embedding is safe to retry."""

    status, type, code = 503, "service_unavailable", "engine_unavailable"


class InternalError(EmbedfleetError):
    status, type, code = 500, "internal_error", "internal_error"


# -- echoing a client's value ---------------------------------------------------------------
def clip(value: object, limit: int = 64) -> str:
    """``value`` as an error message may echo it: its repr, cut after ``limit`` characters with an
    ellipsis and the original size, e.g. ``'aaaa…' (100000 chars)``.

    A message that repeats what the client sent must stay small whatever was sent (a 100 KB model
    name, an 8 MiB list), and must not fail on it: the rendering reads only as much of ``value``
    as it shows, so it never recurses deeper than ``limit`` levels (a list nested 1,000 deep
    breaks ``repr`` and orjson's encoder, which stops at 255) and never converts a huge int.
    """
    if isinstance(value, str):
        if len(value) <= limit and len(text := repr(value)) <= limit + 2:
            return text
        n = min(len(value), limit)
        while n > 1 and len(repr(value[:n])) > limit + 2:  # escapes make a repr longer
            n -= 1
        text = repr(value[:n])
        return f"{text[:-1]}…{text[-1]} ({len(value)} chars)"
    try:
        text = _render(value, limit + 1)
    except RecursionError:  # a limit deeper than the interpreter's stack: say what it was
        return f"<{type(value).__name__}>"
    if len(text) <= limit:
        return text
    size = ""
    if isinstance(value, (list, tuple, dict)):
        noun = "key" if isinstance(value, dict) else "item"
        size = f" ({len(value)} {noun}{'' if len(value) == 1 else 's'})"
    return f"{text[:limit]}…{size}"


def _render(value: object, room: int) -> str:
    """``repr(value)``, or a prefix of it longer than ``room`` (the caller cuts it there)."""
    if isinstance(value, str):
        return repr(value[:room])
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        # repr() of an int over 4,300 digits raises; such an int is shown by its size
        bits = value.bit_length()
        return repr(value) if bits <= 4 * room else f"<int of {bits} bits>"
    if isinstance(value, (list, tuple, dict)):
        items = value.items() if isinstance(value, dict) else value
        text = "{" if isinstance(value, dict) else "[" if isinstance(value, list) else "("
        for i, item in enumerate(items):
            if len(text) > room:
                return text
            if i:
                text += ", "
            if isinstance(value, dict):
                text += _render(item[0], room - len(text)) + ": "
                item = item[1]
            text += _render(item, room - len(text))
        return text + ("}" if isinstance(value, dict) else "]" if isinstance(value, list)
                       else ",)" if len(value) == 1 else ")")
    try:
        return repr(value)[:room + 1]
    except Exception:  # a repr that fails is not the client's problem
        return f"<{type(value).__name__}>"


def error_response(err: EmbedfleetError) -> Response:
    return Response(orjson.dumps(err.body()), status_code=err.status,
                    headers=err.headers(), media_type="application/json")


def internal_error_response(exc: BaseException, context: str) -> Response:
    """An unexpected exception: log it with its traceback and answer 500, never a 4xx."""
    logger.error("internal error in %s: %r", context, exc, exc_info=exc)
    return error_response(InternalError(f"internal error ({type(exc).__name__}); see server log"))
