"""The OpenAPI document of the HTTP API: each route's request body, responses and every error.

The handlers read and validate the raw body themselves (``ingress/http.py``), so that bad JSON is a
400 and a wrong content type a 415, both with embedfleet's one error body, instead of FastAPI's
``{"detail": ...}`` 422. FastAPI therefore sees no body parameter and no error response of its
own; ``doc(path)`` hands both to the route decorator in ``ingress/router.py`` (``openapi_extra`` for
the body, as FastAPI documents for routes that read the raw request; ``responses`` for the rest).

``ROUTE_ERRORS`` is the one list of what each route can fail with, as the error classes of
``errors.py``: their statuses, codes and Retry-After come from there, so the document cannot
drift from the mapping.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from .openai import EmbeddingRequest, EmbeddingResponse
from .cohere import CohereEmbedRequest, CohereEmbedResponse
from .rerank import OPENAPI_ROUTES as RERANK_ROUTES
from .tei import (TeiEmbedRequest, TeiEmbedResponse,
              TeiTokenizeRequest, TeiTokenizeResponse)
from ..common.contracts import CardStatus, ModelStatus, PrefixCacheView
from ..config.rerank import ModelTask
from ..common.errors import (BodyTooLarge, EmbedfleetError, EngineUnavailable,
                      InputTooLong, InvalidJSON, InvalidParameterValue,
                      InvalidTokenId, ModelNotFound, NotReady, Overloaded,
                      RequestTooLarge, RequestValidation, TooManyInputs,
                      Unauthorized,
                      LaneNotAllowed, ModelNotAllowed,
                      UnsupportedMediaType, UnsupportedParameter)


# -- the error body (errors.EmbedfleetError.body) ----------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorBody(BaseModel):
    """Every error, on every route: OpenAI's error object."""

    error: ErrorDetail


# -- the bodies routes.py builds itself (/v1/models, /health, /ready) ------------------------
# The model state's Literal is the fleet status's own, so a new state cannot go undocumented.
ModelState = ModelStatus.model_fields["state"].annotation


class PublicCard(CardStatus):
    """A card as /v1/models shows it: its node and its replica's pid only with
    ``router.expose_replica_details`` (routes.py)."""

    node: str | None = None
    pid: int | None = None


class ModelReplicas(BaseModel):
    ready: int
    min: int
    max: int
    state: ModelState
    waiting: str
    cards: list[PublicCard]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    task: ModelTask = Field(description="The model's role: embed (/v1/embeddings, /embed, "
                            "/v2/embed) or rerank (/rerank, /v1/rerank, /v2/rerank, /score).")
    max_input_tokens: int | None
    dimensions: int | None
    matryoshka_dimensions: list[int]
    replicas: ModelReplicas
    prefix_cache: PrefixCacheView


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


class ReadinessDetail(BaseModel):
    ready: int
    min: int
    max: int
    state: ModelState


class Readiness(BaseModel):
    models: dict[str, int]
    detail: dict[str, ReadinessDetail]
    waiting: dict[str, str]


class Ready(Readiness):
    status: Literal["ready"]


class NotReadyBody(ErrorBody, Readiness):
    """/ready's 503: the error body plus the same per-model readiness as its 200."""


# -- what each route can fail with: the one list ---------------------------------------------
# A 500 (errors.InternalError) is a bug, so it is never documented: a fuzzer must flag it.
AUTH = (Unauthorized,)  # only when the app has API keys (ingress/auth.py); /health is always open
BODY = (InvalidJSON, BodyTooLarge, UnsupportedMediaType, RequestValidation)  # read + parse
EMBED = (LaneNotAllowed, ModelNotAllowed, ModelNotFound, TooManyInputs, RequestTooLarge,
         UnsupportedParameter, InvalidParameterValue, InputTooLong, Overloaded, NotReady,
         EngineUnavailable)  # the pipeline, every API
ROUTE_ERRORS: dict[str, tuple[type[EmbedfleetError], ...]] = {
    "/v1/embeddings": AUTH + BODY + EMBED + (InvalidTokenId,),  # token-id input: OpenAI only
    "/embed": AUTH + BODY + EMBED,
    "/v2/embed": AUTH + BODY + EMBED,
    # the model's own tokenizer: the request bounds (422, 413), the replica's tokenize queue
    # (429), request_timeout_s (503 when it does not answer)
    "/tokenize": AUTH + BODY + (LaneNotAllowed, ModelNotAllowed, InvalidParameterValue,
                                ModelNotFound,
                                TooManyInputs, RequestTooLarge, UnsupportedParameter, Overloaded,
                                EngineUnavailable),
    # 503 when the registry (the fleet's status) does not answer in time
    "/v1/models": AUTH + (NotReady,),
    "/health": (),
    "/ready": AUTH + (NotReady,),
    # ingress/rerank.py: the embed routes' errors (a model of the other role is a 400)
    **dict.fromkeys(RERANK_ROUTES, AUTH + BODY + EMBED),
}
# The capacity errors: always sent with Retry-After (errors.EmbedfleetError.headers)
RETRY_LATER = (Overloaded, NotReady, EngineUnavailable)

RETRY_AFTER_HEADER = {"description": "Whole seconds to wait before retrying.", "required": True,
                      "schema": {"type": "integer", "minimum": 1}}
_STR = {"required": True, "schema": {"type": "string"}}
EMBED_HEADERS = {  # on every 200 of the embed routes (routes.py and pipeline.Embedded.headers)
    "x-request-id": {"description": "The request's id in the router's log.", **_STR},
    **{f"x-embedfleet-{name}": {"description": what, **_STR} for name, what in (
        ("model-digest", "Digest of the model's weights that made the vectors."),
        ("dtype", "Engine dtype."), ("engine", "Engine and version."),
        ("platform", "cpu, cuda or ascend."), ("prefix-cache", "on, off, or mixed."),
        ("truncated-inputs", "How many inputs the long-input policy truncated."),
        ("chunked-inputs", "How many inputs were embedded in chunks and merged."),
        ("replicas", "Comma-separated ids of the replicas that served the request."))},
    "x-embedfleet-int8-ranges": {
        "description": "With int8/uint8: the per-dimension ranges used, as their source (config "
        "or calibration) and a digest of their values.", "schema": {"type": "string"}}}

_ROUTES: dict[str, dict[str, Any]] = {
    "/v1/embeddings": {"summary": "Embed texts or token ids (OpenAI's embeddings API)",
                       "request": EmbeddingRequest, "ok": EmbeddingResponse,
                       "ok_headers": EMBED_HEADERS},
    "/embed": {"summary": "Embed texts (Hugging Face TEI's /embed)", "request": TeiEmbedRequest,
               "ok": TeiEmbedResponse, "ok_headers": EMBED_HEADERS},
    "/v2/embed": {"summary": "Embed texts in several encodings at once (Cohere's Embed API v2)",
                  "request": CohereEmbedRequest, "ok": CohereEmbedResponse,
                  "ok_headers": EMBED_HEADERS},
    "/tokenize": {"summary": "Tokenise with the model's own tokenizer (TEI's /tokenize)",
                  "request": TeiTokenizeRequest, "ok": TeiTokenizeResponse},
    "/v1/models": {"summary": "Served models, their replicas, cards and prefix-cache state",
                   "ok": ModelList},
    "/health": {"summary": "The router process is alive (open even with API keys)",
                "ok": Health},
    "/ready": {"summary": "Every model that must stay up has a ready replica", "ok": Ready,
               "error_models": {NotReady.status: NotReadyBody}},
    **RERANK_ROUTES,
}


def error_responses(path: str, models: dict[int, type[BaseModel]] | None = None,
                    ) -> dict[int, dict[str, Any]]:
    """FastAPI ``responses`` for ``path``'s errors: one per status, naming the codes behind it;
    the body is ``ErrorBody`` unless ``models`` names another for the status."""
    by_status: dict[int, list[type[EmbedfleetError]]] = {}
    for cls in ROUTE_ERRORS[path]:
        by_status.setdefault(cls.status, []).append(cls)
    out: dict[int, dict[str, Any]] = {}
    for status, classes in sorted(by_status.items()):
        codes = ", ".join(dict.fromkeys(f"`{c.code}`" for c in classes))
        entry: dict[str, Any] = {"model": (models or {}).get(status, ErrorBody),
                                 "description": f"error code {codes}"}
        if any(issubclass(c, RETRY_LATER) for c in classes):
            entry["headers"] = {"Retry-After": RETRY_AFTER_HEADER}
        if Unauthorized in classes:
            entry["description"] += " (only when the router has API keys)"
        out[status] = entry
    return out


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    # Inline: the request models have no nested models, so their schema needs no components.
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": model.model_json_schema()}}}}


def doc(path: str) -> dict[str, Any]:
    """The keyword arguments of ``path``'s route decorator that document it."""
    spec = _ROUTES[path]
    ok: dict[str, Any] = {"model": spec["ok"], "description": "OK"}
    if "ok_headers" in spec:
        ok["headers"] = spec["ok_headers"]
    kwargs: dict[str, Any] = {
        "summary": spec["summary"],
        "responses": {200: ok, **error_responses(path, spec.get("error_models"))}}
    if "request" in spec:
        kwargs["openapi_extra"] = request_body(spec["request"])
    return kwargs
