"""The HTTP API: thin adapters from OpenAI's and TEI's wire shapes to the one embed pipeline.

``ApiRoutes`` holds the handlers; ``ingress/router.py`` mounts them on a FastAPI app per Serve
application (its own API keys included). Each handler: read the bounded JSON body, validate it
against its API's schema (422), hand an ``EmbedRequest`` to the pipeline (404 unknown model, 422
too many inputs, 400 what the model cannot honour, 429/503 when it cannot serve now), build the
API's response. Metrics are recorded in batches, off the request path.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from starlette.responses import Response

from ..common import metrics
from .auth import allowed_models, check_model_allowed
from .http import json_response, read_json_body
from .lanes import request_lane
from .openai import (embedding_response, parse_embedding_request,
                 to_pipeline)
from .tei import (parse_tei_embed_request, parse_tei_tokenize_request,
              tei_embed_response, tei_to_pipeline,
              tei_tokenize_response)
from .cohere import cohere_embed_response, cohere_to_pipeline, parse_cohere_embed_request
from .encodings import Encoded, encoder_for
from ..config.schema import EmbedfleetConfig
from ..common.contracts import BatchCall, BatchResult, FleetStatus, Lane
from ray.serve.exceptions import BackPressureError

from ..common.errors import (EmbedfleetError, EngineUnavailable, NotReady, Overloaded,
                             error_response, internal_error_response)
from .pipeline import (REPLICAS_HEADER, EmbedPipeline,
                           EmbedRequest, Embedded, check_request_size)
from .remote import REPLICA_GONE
from .rerank import RerankService

Tokenizer = Callable[[str, list[str], bool, str | None, Lane], Awaitable[list]]


class ApiRoutes:
    def __init__(self, cfg: EmbedfleetConfig, pipeline: EmbedPipeline,
                 status: Callable[[], Awaitable[FleetStatus]], tokenize: Tokenizer,
                 recorder: metrics.Batched) -> None:
        self.cfg = cfg
        self.pipeline = pipeline
        self.encoder = encoder_for(pipeline)  # compact encodings of the final vectors
        self._status = status
        self._tokenize = tokenize
        self._rec = recorder
        self._default_model = cfg.models[0].name
        self.started = int(time.time())
        self.rerank = RerankService(cfg, pipeline)  # its callers: the Router's rerankers

    async def _answer(self, api: str, where: str,
                      handle: Callable[[list[str]], Awaitable[Response]]) -> Response:
        """Run one handler; own its status, metrics and error mapping. ``handle`` appends the
        model it resolved to ``seen`` (a bounded label value once checked)."""
        t0, seen, status = time.perf_counter(), [], 500
        try:
            response = await handle(seen)
            status = response.status_code
            return response
        except EmbedfleetError as err:
            status = err.status
            return error_response(err)
        except Exception as exc:
            return internal_error_response(exc, where)
        finally:
            self._record(api, seen[-1] if seen else "", status, t0)

    def _record(self, api: str, model: str, status: int, t0: float) -> None:
        """One request's count and latency (an unknown model's name is never a label value)."""
        model = model if model in self.pipeline.models else "_unknown"
        self._rec.inc("embedfleet_requests_total", 1,
                      {"model": model, "api": api, "status_code": str(status)})
        self._rec.observe("embedfleet_request_latency_seconds", time.perf_counter() - t0,
                          {"model": model, "api": api})

    def _served(self, model: str, n: int, tokens: int) -> None:
        self._rec.inc("embedfleet_inputs_total", n, {"model": model})
        self._rec.inc("embedfleet_input_tokens_total", tokens, {"model": model})

    async def _embed(self, req: EmbedRequest, request_id: str, encodings: list[str]
                     ) -> tuple[Embedded, Encoded, dict[str, str]]:
        """Run the pipeline, count what it served, and encode the final vectors (after slices
        and chunks are merged and ``dimensions`` applied); the response headers with them."""
        out = await self.pipeline.run(req, request_id)
        self._served(req.model, len(out.vectors), out.prompt_tokens)
        enc = await self.encoder.encode(req.model, out.vectors, encodings,
                                        dimensions=req.dimensions, normalize=req.normalize)
        return out, enc, {"x-request-id": request_id, **out.headers, **enc.headers}

    async def embeddings(self, request: Request) -> Response:
        request_id = f"emb-{uuid.uuid4().hex[:16]}"

        async def handle(seen: list[str]) -> Response:
            req = parse_embedding_request(
                await read_json_body(request, self.cfg.router.max_body_bytes))
            seen.append(req.model)
            check_model_allowed(request.state, req.model)  # the key's models= (403)
            out, enc, headers = await self._embed(
                to_pipeline(req, request_lane(request, req.lane)), request_id,
                [req.encoding_format])
            body = embedding_response(enc.arrays[req.encoding_format], model=req.model,
                                      prompt_tokens=out.prompt_tokens,
                                      encoding=req.encoding_format,
                                      cached_tokens=out.cached_tokens, inputs_report=out.inputs)
            return json_response(body, raw=True, headers=headers)

        return await self._answer("embeddings", f"/v1/embeddings {request_id}", handle)

    async def tei_embed(self, request: Request) -> Response:
        """Hugging Face TEI's /embed: the same pipeline, TEI's request and response shapes."""
        request_id = f"tei-{uuid.uuid4().hex[:16]}"

        async def handle(seen: list[str]) -> Response:
            req = parse_tei_embed_request(
                await read_json_body(request, self.cfg.router.max_body_bytes))
            model = req.model or self._default_model
            seen.append(model)
            check_model_allowed(request.state, model)  # the key's models= (403)
            _, enc, headers = await self._embed(
                tei_to_pipeline(req, model, request_lane(request, req.lane)), request_id,
                [req.encoding_format])
            return json_response(tei_embed_response(enc.arrays[req.encoding_format]), raw=True,
                                 headers=headers)

        return await self._answer("embed", f"/embed {request_id}", handle)

    async def cohere_embed(self, request: Request) -> Response:
        """Cohere's /v2/embed: the same pipeline, several encodings of each vector at once."""
        request_id = f"coh-{uuid.uuid4().hex[:16]}"

        async def handle(seen: list[str]) -> Response:
            req = parse_cohere_embed_request(
                await read_json_body(request, self.cfg.router.max_body_bytes))
            seen.append(req.model)
            check_model_allowed(request.state, req.model)  # the key's models= (403)
            m = self.pipeline.resolve(req.model)
            out, enc, headers = await self._embed(
                cohere_to_pipeline(req, m, request_lane(request, req.lane)), request_id,
                list(req.embedding_types))
            body = cohere_embed_response(request_id, req.texts, enc.arrays, out.prompt_tokens)
            return json_response(body, raw=True, headers=headers)

        return await self._answer("embed_v2", f"/v2/embed {request_id}", handle)

    async def embed_batch(self, call: BatchCall) -> BatchResult:
        """The Serve-handle API (``embedfleet embed-corpus``): the same pipeline as HTTP, no wire
        format. Errors are raised as they are (typed, they pickle through Ray), so the caller
        retries 429/503 by their ``retry_after_s`` and refuses the row a 4xx names."""
        request_id = f"batch-{uuid.uuid4().hex[:16]}"
        t0, status = time.perf_counter(), 500
        try:
            out = await self.pipeline.run(EmbedRequest(call.model, call.texts, "texts",
                                                       prompt_name=call.prompt_name,
                                                       long_input_mode=call.long_input,
                                                       chunk_above=call.chunk_above,
                                                       lane=call.lane), request_id)
            status = 200
        except EmbedfleetError as err:
            status = err.status
            raise
        finally:
            self._record("batch", call.model, status, t0)
        self._served(call.model, len(out.vectors), out.prompt_tokens)
        return BatchResult(out.vectors, tuple(r.input_tokens for r in out.inputs),
                           {k: v for k, v in out.headers.items()
                            if k.startswith("x-embedfleet-") and not k.endswith("-inputs")
                            and k != REPLICAS_HEADER})

    async def tei_tokenize(self, request: Request) -> Response:
        """TEI's /tokenize with the model's own tokenizer (offsets into the input text)."""
        async def handle(seen: list[str]) -> Response:
            req = parse_tei_tokenize_request(
                await read_json_body(request, self.cfg.router.max_body_bytes))
            model = req.model or self._default_model
            seen.append(model)
            check_model_allowed(request.state, model)  # the key's models= (403)
            # the same bounds as /embed before any work: inputs, characters (413)
            check_request_size(self.cfg, self.pipeline.resolve(model), req.inputs, "inputs")
            lane = request_lane(request, None)
            router = self.cfg.router
            try:
                tokens = await asyncio.wait_for(
                    self._tokenize(model, req.inputs, req.add_special_tokens, req.prompt_name,
                                   lane), timeout=router.request_timeout_s)
            except asyncio.TimeoutError:  # no answer in time: the server's state, not a 500
                raise EngineUnavailable(
                    f"model '{model}' did not tokenise within {router.request_timeout_s:g}s",
                    retry_after_s=router.retry_after_s) from None
            except REPLICA_GONE as err:
                raise EngineUnavailable(f"model '{model}': its replica died while tokenising "
                                        f"({type(err).__name__})",
                                        retry_after_s=router.retry_after_s) from None
            except BackPressureError:
                raise Overloaded(f"model '{model}' is at capacity",
                                 retry_after_s=router.retry_after_s) from None
            return json_response(tei_tokenize_response(tokens), raw=True)

        return await self._answer("tokenize", "/tokenize", handle)

    # Rerank routes (ingress/rerank.py): TEI's, Jina/Cohere's as vLLM answers them, vLLM's /score
    async def tei_rerank(self, request: Request) -> Response:
        return await self._answer("rerank", "/rerank", lambda seen: self.rerank.tei(request, seen))

    async def rerank_api(self, request: Request, path: str) -> Response:
        return await self._answer("rerank", path,
                                  lambda seen: self.rerank.rerank_api(request, seen))

    async def score(self, request: Request) -> Response:
        return await self._answer("score", "/score", lambda seen: self.rerank.score(request, seen))

    async def _fleet(self) -> FleetStatus:
        """The fleet's status, or 503 + Retry-After when the registry cannot give it (restarting,
        overloaded): a status page is never a 500."""
        try:
            return await self._status()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise NotReady(f"the fleet's status is unavailable ({type(exc).__name__}); the "
                           "registry may be restarting", retry_after_s=self.cfg.router.retry_after_s
                           ) from None

    async def models(self, request: Request | None = None) -> Response:
        """The served models: those the request's API key may use (``models=`` in the keys
        file). A card is named by its device alone unless the operator set
        ``router.expose_replica_details``: node names are addresses by default, and neither
        they nor process ids are a client's business."""
        st = await self._fleet()
        allowed = None if request is None else allowed_models(request.state)
        hidden = None if self.cfg.router.expose_replica_details else {"node", "pid"}
        data = [{
            "id": m.model, "object": "model", "created": self.started, "owned_by": "embedfleet",
            "task": self.cfg.model(m.model).task,  # the model's role: which routes it answers
            "max_input_tokens": m.max_input_tokens, "dimensions": m.dimensions,
            "matryoshka_dimensions": m.matryoshka_dimensions,
            "replicas": {"ready": m.ready, "min": m.min_replicas, "max": m.max_replicas,
                         "state": m.state, "waiting": m.waiting,
                         "cards": [c.model_dump(mode="json", exclude=hidden)
                                   for c in m.cards]},
            "prefix_cache": m.prefix_cache.model_dump(mode="json"),
        } for m in st.models if allowed is None or m.model in allowed]
        return json_response({"object": "list", "data": data})

    async def health(self) -> Response:
        return json_response({"status": "ok"})

    async def ready(self) -> Response:
        """200 while every model that must stay up (min_replicas >= 1) has a ready replica.

        A scale-to-zero model at zero is ready (its first request starts a replica); a model whose
        replicas cannot get a card says so under ``waiting``, whatever the status."""
        try:
            st = await self._fleet()
        except NotReady as err:  # no status at all: not ready, with nothing known per model
            return json_response({**err.body(), "models": {}, "detail": {}, "waiting": {}},
                                 status=503, headers=err.headers())
        extra: dict[str, Any] = {
            "models": {m.model: m.ready for m in st.models},
            "detail": {m.model: {"ready": m.ready, "min": m.min_replicas, "max": m.max_replicas,
                                 "state": m.state} for m in st.models},
            "waiting": {m.model: m.waiting for m in st.models if m.waiting}}
        missing = st.missing
        if missing:
            why = "; ".join(f"{n}: {extra['waiting'][n]}" for n in missing
                            if n in extra["waiting"])
            err = NotReady(f"no ready replica for model(s): {', '.join(missing)}"
                           + (f" ({why})" if why else ""),
                           retry_after_s=self.cfg.router.retry_after_s)
            return json_response({**err.body(), **extra}, status=503, headers=err.headers())
        return json_response({"status": "ready", **extra})
