"""Every rerank shape users already call, translated into one replica call (``RerankCall``).

* TEI ``POST /rerank``: ``query``, ``texts``, ``truncate``, ``raw_scores``, ``return_text`` ->
  ``[{"index", "score", "text"?}]`` sorted by score, best first (TEI's ``router/src/http``).
* Jina/Cohere-style ``POST /v1/rerank`` and ``/v2/rerank``: ``query``, ``documents``, ``top_n``,
  ``return_documents`` -> ``{"id", "model", "usage", "results": [{"index", "document",
  "relevance_score"}]}`` as vLLM 0.32 answers them (``entrypoints/pooling/scoring/serving.py``:
  sorted best first, ``top_n`` 0 = all, ``document`` ``{"text", "multi_modal": null}``);
  ``return_documents: false`` leaves ``document`` out, as Cohere and Jina do.
* vLLM's ``POST /score``: ``text_1`` (one text, or one a pair) and ``text_2`` -> ``{"id",
  "object": "list", "created", "model", "data": [{"index", "object": "score", "score"}],
  "usage"}``, in pair order.

Each goes through what embeddings go through: the model's API-key scope, the request bounds
(``pipeline.check_request_size``: inputs, characters), the model's router share
(``EmbedPipeline.held``: 429 past it), then the replica's token bound, admission,
lanes and engine gate (``replica/rerank_path.py``), and the one error mapping. A model's role is
checked first: an embedding model asked to rerank is a 400 that says so (and the embed pipeline
refuses a reranker the same way). ``model`` is optional on TEI's route (the first reranker).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, RootModel
from starlette.requests import Request
from starlette.responses import Response

from ..common.contracts import Lane, merged_headers
from ..common.errors import InvalidParameterValue, ModelNotFound, RequestValidation
from ..common.rerank_calls import RerankCall, RerankResult
from ..config.schema import EmbedfleetConfig, ModelConfig
from .auth import check_model_allowed
from .http import json_response, read_json_body
from .lanes import request_lane
from .openai import parse_body
from .pipeline import REPLICAS_HEADER, Caller, EmbedPipeline, call_all, check_request_size

class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TeiRerankRequest(_Req):
    query: str = Field(min_length=1, description="Scored against every text.")
    texts: list[str] = Field(min_length=1, description="The texts to rank.")
    truncate: bool = Field(default=False, description="Cut a text that does not fit the "
                           "model's context with the query; false: such a text is a 400.")
    truncation_direction: Literal["Right", "right"] = Field(
        default="Right", description="A too-long text is cut at its end (the query is kept).")
    raw_scores: bool = Field(default=False, description="The classifier's logits instead of "
                             "its activation (sigmoid).")
    return_text: bool = Field(default=False, description="Echo each text beside its score.")
    model: str | None = Field(default=None, min_length=1, description="embedfleet: the "
                              "served reranker (TEI serves one); absent = the first reranker.")


class RerankApiRequest(_Req):
    """Jina's and Cohere's rerank, as vLLM takes it at /v1/rerank and /v2/rerank."""

    model: str = Field(min_length=1)
    query: str = Field(min_length=1, description="Scored against every document.")
    documents: list[str] = Field(min_length=1, description="The documents to rank.")
    top_n: NonNegativeInt = Field(default=0, description="The best this many; 0 = all.")
    return_documents: bool = Field(default=True, description="Echo each document's text "
                                   "(vLLM always does; false leaves document out).")
    truncate: bool = Field(default=False, description="embedfleet: cut a document that does "
                           "not fit the model's context with the query, else 400.")
    user: str | None = None


class ScoreRequest(_Req):
    """vLLM's /score: one text_1 against every text_2, or pairs of equal-length lists."""

    model: str = Field(min_length=1)
    text_1: str | list[str] = Field(description="One text scored against every text_2, or "
                                    "one for each text_2.")
    text_2: str | list[str] = Field(description="The texts to score.")
    truncate: bool = False
    user: str | None = None


class TeiRank(BaseModel):
    index: int
    score: float
    text: str | None = None


class TeiRerankResponse(RootModel[list[TeiRank]]):
    """A bare list, best first."""


class RerankDocument(BaseModel):
    text: str | None
    multi_modal: None = None


class RerankItem(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankApiResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankItem]


class ScoreItem(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreUsage(RerankUsage):
    completion_tokens: int = 0
    prompt_tokens_details: None = None


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreItem]
    usage: ScoreUsage


# -- response builders (pure) --------------------------------------------------------------
def best_first(scores: list[float]) -> list[int]:
    """Document indices by score, best first; ties keep input order (a stable sort)."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])


def tei_rerank_response(scores: list[float], texts: list[str], return_text: bool) -> list:
    return [{"index": i, "score": scores[i], **({"text": texts[i]} if return_text else {})}
            for i in best_first(scores)]


def rerank_api_response(request_id: str, model: str, scores: list[float], docs: list[str],
                        top_n: int, return_documents: bool, tokens: int) -> dict[str, Any]:
    order = best_first(scores)
    order = order[:top_n] if 0 < top_n < len(order) else order
    results = [{"index": i, **({"document": {"text": docs[i], "multi_modal": None}}
                               if return_documents else {}),
                "relevance_score": scores[i]} for i in order]
    return {"id": request_id, "model": model, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def score_response(request_id: str, model: str, scores: list[float], tokens: int
                   ) -> dict[str, Any]:
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's /score pairing: 1 x N broadcasts the one text_1, N x N zips (422 otherwise)."""
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    if not left or not right or any(not t for t in left + right):
        raise RequestValidation("text_1 and text_2 must be non-empty texts or lists of them",
                                param="text_2" if left else "text_1")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise RequestValidation(f"text_1 has {len(left)} texts and text_2 {len(right)}: give "
                                "one text_1, or as many as text_2", param="text_1")
    return list(zip(left, right))


# -- the service ---------------------------------------------------------------------------
class RerankService:
    """The rerank routes' model resolution and replica calls; ``callers`` are the rerankers'
    (``RemoteCaller(..., method="rerank")``, set by the Router)."""

    def __init__(self, cfg: EmbedfleetConfig, pipeline: EmbedPipeline) -> None:
        self.cfg = cfg
        self.pipeline = pipeline
        self.callers: dict[str, Caller] = {}
        self.default_model = next((m.name for m in cfg.models if m.task == "rerank"), None)

    def resolve(self, model: str | None) -> ModelConfig:
        if model is None:
            if self.default_model is None:
                raise InvalidParameterValue("no served model reranks (none has task: rerank)",
                                            param="model")
            model = self.default_model
        m = self.pipeline.resolve(model)  # 404 for an unknown name
        if m.task != "rerank":
            raise InvalidParameterValue(
                f"model '{m.name}' is an embedding model (task: embed); it does not rerank. "
                f"Rerankers here: {', '.join(self.callers) or 'none'}", param="model")
        if m.name not in self.callers:
            raise ModelNotFound(f"model '{m.name}' is not served by this ingress", param="model")
        return m

    def admit(self, request: Request, seen: list[str], model: str | None, texts: list[str],
              param: str) -> tuple[ModelConfig, Lane]:
        """The checks before any replica call: role (400), the key's models= (403), the
        request's size (422, 413); the model and the request's lane."""
        m = self.resolve(model)
        seen.append(m.name)
        check_model_allowed(request.state, m.name)
        check_request_size(self.cfg, m, texts, param)
        return m, request_lane(request, None)

    async def call(self, request: Request, seen: list[str], model: str | None, query: str,
                   docs: list[str], *, truncate: bool, raw: bool, param: str
                   ) -> tuple[ModelConfig, RerankResult, str]:
        """One request, one replica call, inside the model's router share (429 past it)."""
        m, lane = self.admit(request, seen, model, [query, *docs], param)
        request_id = f"rr-{uuid.uuid4().hex[:16]}"
        with self.pipeline.held(m.name, lane):
            res = await self.callers[m.name](RerankCall(query, docs, request_id, m.name,
                                                        truncate, raw, lane))
        return m, res, request_id

    def _headers(self, request_id: str, results: list[RerankResult]) -> dict[str, str]:
        return {"x-request-id": request_id, **merged_headers([r.fingerprint for r in results]),
                REPLICAS_HEADER: ",".join(sorted({r.replica_id for r in results}))}

    async def _body(self, request: Request, model: type[BaseModel]) -> Any:
        return parse_body(model, await read_json_body(request, self.cfg.router.max_body_bytes))

    # -- the four routes ---------------------------------------------------------------------
    async def tei(self, request: Request, seen: list[str]) -> Response:
        req: TeiRerankRequest = await self._body(request, TeiRerankRequest)
        m, res, rid = await self.call(request, seen, req.model, req.query, req.texts,
                                      truncate=req.truncate, raw=req.raw_scores, param="texts")
        return json_response(tei_rerank_response(res.scores, req.texts, req.return_text),
                             headers=self._headers(rid, [res]))

    async def rerank_api(self, request: Request, seen: list[str]) -> Response:
        req: RerankApiRequest = await self._body(request, RerankApiRequest)
        m, res, rid = await self.call(request, seen, req.model, req.query, req.documents,
                                      truncate=req.truncate, raw=False, param="documents")
        return json_response(rerank_api_response(rid, m.name, res.scores, req.documents,
                                                 req.top_n, req.return_documents,
                                                 res.prompt_tokens),
                             headers=self._headers(rid, [res]))

    async def score(self, request: Request, seen: list[str]) -> Response:
        req: ScoreRequest = await self._body(request, ScoreRequest)
        pairs = score_pairs(req.text_1, req.text_2)
        groups: dict[str, list[int]] = {}  # one replica call per distinct text_1
        for i, (q, _) in enumerate(pairs):
            groups.setdefault(q, []).append(i)
        m, lane = self.admit(request, seen, req.model, [t for p in pairs for t in p], "text_2")
        rid = f"rr-{uuid.uuid4().hex[:16]}"
        calls = [RerankCall(q, [pairs[i][1] for i in idx], f"{rid}-{k}", m.name, req.truncate,
                            False, lane) for k, (q, idx) in enumerate(groups.items())]
        with self.pipeline.held(m.name, lane):  # one request, one share, however many calls
            # the first call to fail cancels the others, as an embedding request's slices
            results = await call_all(self.callers[m.name], calls)
        scores = [0.0] * len(pairs)
        for idx, res in zip(groups.values(), results):
            for i, s in zip(idx, res.scores):
                scores[i] = s
        return json_response(score_response(rid, m.name, scores,
                                            sum(r.prompt_tokens for r in results)),
                             headers=self._headers(rid, results))


# The OpenAPI document's entries for these routes (``ingress/openapi.py`` merges them).
OPENAPI_ROUTES: dict[str, dict[str, Any]] = {
    "/rerank": {"summary": "Rerank texts against a query (Hugging Face TEI's /rerank)",
                "request": TeiRerankRequest, "ok": TeiRerankResponse},
    "/v1/rerank": {"summary": "Rerank documents (Jina/Cohere style, as vLLM answers it)",
                   "request": RerankApiRequest, "ok": RerankApiResponse},
    "/v2/rerank": {"summary": "Rerank documents (Cohere's v2 shape, as vLLM answers it)",
                   "request": RerankApiRequest, "ok": RerankApiResponse},
    "/score": {"summary": "Score text pairs with a reranker (vLLM's /score)",
               "request": ScoreRequest, "ok": ScoreResponse},
}
