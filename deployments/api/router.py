"""Router: the HTTP ingress (FastAPI under Serve) speaking the OpenAI embeddings API.

Per request: bound the body, check the content type, decode JSON, validate against the protocol
model, resolve the model by name, then call that model's engine replicas through its Serve handle
(large requests are sliced so several replicas share them). Every failure leaves through
``errors.error_response``; an unexpected exception is a logged 500, never a 4xx.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import orjson
from fastapi import FastAPI, Request
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from embedfleet.deployments import metrics
from embedfleet.deployments.api.auth import ApiKeyMiddleware, load_api_keys
from embedfleet.deployments.request_path.cold_start import HoldExpired, await_with_hold
from embedfleet.deployments.config import EmbedfleetConfig, parse_config
from embedfleet.deployments.errors import (
    BodyTooLarge,
    EmbedfleetError,
    EngineUnavailable,
    InvalidJSON,
    MethodNotAllowed,
    ModelNotFound,
    NotReady,
    Overloaded,
    RouteNotFound,
    TooManyInputs,
    UnsupportedMediaType,
    error_response,
    internal_error_response,
)
from embedfleet.deployments.options import engine_deployment_name
from embedfleet.deployments.control.placement import waiting_reasons
from embedfleet.deployments.api.openai import embedding_response, parse_embedding_request
from embedfleet.deployments.api.tei import (
    parse_tei_embed_request,
    parse_tei_tokenize_request,
    tei_embed_response,
    tei_tokenize_response,
)
from embedfleet.deployments.replica import EmbedCall, EmbedResult

logger = logging.getLogger("embedfleet.router")

# Inputs per engine call: large requests are sliced so that several replicas work on them at once,
# while each slice stays big enough for the engine to batch well.
SLICE_INPUTS = 128
# A replica that dies mid-call is replaced by Serve; embedding is idempotent, so retry elsewhere.
MAX_ATTEMPTS = 3
REPLICA_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)

app = FastAPI(title="embedfleet", version="0.1.0", redirect_slashes=False,
              description="OpenAI-compatible embeddings over vLLM pooling engines on Ray Serve.")
# Set by the Router at start-up (one router per process); empty = the API is open.
_API_KEYS: tuple[bytes, ...] = ()
app.add_middleware(ApiKeyMiddleware, keys_provider=lambda: _API_KEYS)


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


def long_input_headers(report: list[dict[str, Any]]) -> dict[str, str]:
    """Counts of what the long-input policy did, as headers (for TEI clients too)."""
    return {"x-embedfleet-truncated-inputs": str(sum(1 for r in report if r["truncated"])),
            "x-embedfleet-chunked-inputs": str(sum(1 for r in report if r["chunks"] > 1))}


def merge_fingerprints(results: list[EmbedResult]) -> dict[str, str]:
    """One fingerprint per response; a field on which the slices' replicas differ says "mixed"
    (e.g. one replica had already switched prefix caching off), so a client can see it."""
    merged = dict(results[0].fingerprint)
    for r in results[1:]:
        for k, v in r.fingerprint.items():
            if merged.get(k) != v:
                merged[k] = "mixed"
    return merged


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
    async for chunk in request.stream():
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


@serve.ingress(app)
class Router:
    def __init__(self, config: dict[str, Any], engines: dict[str, Any], registry: Any,
                 governor: Any = None) -> None:
        global _API_KEYS
        self.cfg: EmbedfleetConfig = parse_config(config, "router args")
        _API_KEYS = load_api_keys(self.cfg.router.api_keys_file, self.cfg.router.api_keys_env)
        logger.info("router up; API keys %s", f"required ({len(_API_KEYS)})" if _API_KEYS
                    else "not configured (open API)")
        self.engines = engines
        self.registry = registry
        self.governor = governor
        self.started = int(time.time())

    # -- helpers -------------------------------------------------------------------------------
    def _engine(self, model: str) -> Any:
        handle = self.engines.get(model)
        if handle is None:
            known = ", ".join(sorted(self.engines))
            raise ModelNotFound(f"model '{model}' does not exist; served models: {known}",
                                param="model")
        return handle

    async def _snapshot(self) -> dict[str, list[dict[str, Any]]]:
        try:
            return await asyncio.wait_for(self.registry.snapshot.remote(), timeout=5)
        except Exception as exc:
            logger.warning("FleetRegistry snapshot failed: %r", exc)
            return {}

    async def _waiting_reasons(self) -> dict[str, str]:
        """{model: why replicas wait for a card}, from Ray's state API (off the event loop)."""
        deployments = {engine_deployment_name(m.name): m.name for m in self.cfg.models}
        try:
            return await asyncio.wait_for(asyncio.to_thread(
                waiting_reasons, self.cfg.app_name, self.cfg.platform.card_resource,
                deployments), timeout=10)
        except Exception as exc:
            logger.warning("placement query failed: %r", exc)
            return {}

    async def _call(self, handle: Any, call: EmbedCall) -> EmbedResult:
        retry_after = self.cfg.router.retry_after_s
        bounds = self.cfg.model(call.model).replicas
        # Only a scale-to-zero model is held for a cold start; a model that should always have a
        # replica answers 503 + Retry-After within request_timeout_s when none can serve.
        hold_s = bounds.cold_start_hold_s if bounds.min_replicas == 0 else 0.0
        last: BaseException | None = None
        for attempt in range(MAX_ATTEMPTS):
            response = handle.embed.remote(call)
            try:
                return await await_with_hold(
                    response, self.cfg.router.request_timeout_s, hold_s,
                    lambda: self._has_ready(call.model))
            except BackPressureError as err:
                metrics.get("embedfleet_overload_rejections_total").inc(
                    1, tags={"model": call.model, "reason": "serve_queue_full"})
                raise Overloaded(f"model is at capacity ({err}); retry after {retry_after}s",
                                 retry_after_s=retry_after) from None
            except DeploymentUnavailableError as err:
                raise NotReady(str(err.message), retry_after_s=retry_after) from None
            except HoldExpired as err:
                response.cancel()
                if err.no_replica:
                    why = (await self._waiting_reasons()).get(call.model, "no replica came up")
                    raise NotReady(f"model '{call.model}' has no ready replica; the request was "
                                   f"held {err.waited_s:.0f}s (cold_start_hold_s={hold_s:g}): "
                                   f"{why}", retry_after_s=retry_after) from None
                raise EngineUnavailable(
                    f"no replica answered within {err.waited_s:.0f}s",
                    retry_after_s=retry_after) from None
            except (EngineUnavailable, *REPLICA_GONE) as err:
                last = err
                logger.warning("replica died during %s (attempt %d/%d): %r", call.request_id,
                               attempt + 1, MAX_ATTEMPTS, err)
                await asyncio.sleep(0.2 * (attempt + 1))
        raise EngineUnavailable(f"no replica could serve the request after {MAX_ATTEMPTS} "
                                f"attempts ({last})", retry_after_s=retry_after)

    async def _has_ready(self, model: str) -> bool:
        return any(r.get("ready") for r in (await self._snapshot()).get(model, []))

    async def _embed(self, model: str, inputs: list, request_id: str, **call_args: Any
                     ) -> tuple[list[np.ndarray], int, int, dict[str, str], list[dict]]:
        handle = self._engine(model)
        slices = [inputs[i:i + SLICE_INPUTS] for i in range(0, len(inputs), SLICE_INPUTS)]
        calls = [EmbedCall(list(s), request_id=f"{request_id}-{k}", model=model, **call_args)
                 for k, s in enumerate(slices)]
        results = await asyncio.gather(*(self._call(handle, c) for c in calls))
        vectors = [v for r in results for v in r.vectors]
        report = [{**r, "index": k * SLICE_INPUTS + r["index"]}
                  for k, res in enumerate(results) for r in res.inputs]
        return (vectors, sum(r.prompt_tokens for r in results),
                sum(r.cached_tokens for r in results), merge_fingerprints(results), report)

    def _policy(self, model: str, mode: str | None, direction: str | None):
        base = self.cfg.model(model).long_input
        update = {k: v for k, v in (("mode", mode), ("truncation_direction", direction)) if v}
        return base.model_copy(update=update) if update else None

    def _observe(self, model: str, api: str, status: int, t0: float) -> None:
        model = model if model in self.engines else "_unknown"  # bounded label values
        metrics.get("embedfleet_requests_total").inc(
            1, tags={"model": model, "api": api, "status_code": str(status)})
        metrics.get("embedfleet_request_latency_seconds").observe(
            time.perf_counter() - t0, tags={"model": model, "api": api})

    async def _answer(self, api: str, where: str,
                      handle: Callable[[dict[str, str]], Awaitable[Response]]) -> Response:
        """Run one route's handler; own its status, metrics and error mapping.

        ``handle`` records the model it resolved in ``seen["model"]`` (bounded label values)."""
        t0, seen, status = time.perf_counter(), {"model": "_unknown"}, 500
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
            self._observe(seen["model"], api, status, t0)

    def _check_count(self, n: int, param: str) -> None:
        limit = self.cfg.router.max_inputs_per_request
        if n > limit:
            raise TooManyInputs(f"{param} has {n} items; at most {limit} per request", param=param)

    def _count_served(self, model: str, vectors: list, tokens: int) -> None:
        metrics.get("embedfleet_inputs_total").inc(len(vectors), tags={"model": model})
        metrics.get("embedfleet_input_tokens_total").inc(tokens, tags={"model": model})

    # -- routes --------------------------------------------------------------------------------
    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        request_id = f"emb-{uuid.uuid4().hex[:16]}"

        async def handle(seen: dict[str, str]) -> Response:
            req = parse_embedding_request(
                await read_json_body(request, self.cfg.router.max_body_bytes))
            seen["model"] = req.model
            self._check_count(len(req.input), "input")
            self._engine(req.model)
            vectors, tokens, cached, fingerprint, report = await self._embed(
                req.model, req.input, request_id, dimensions=req.dimensions,
                long_input=self._policy(req.model, req.long_input, req.truncation_direction),
                prompt_name=req.prompt_name, task=req.task)
            body = embedding_response(vectors, model=req.model, prompt_tokens=tokens,
                                      encoding=req.encoding_format, cached_tokens=cached,
                                      inputs_report=report)
            self._count_served(req.model, vectors, tokens)
            return Response(body, media_type="application/json",
                            headers={"x-request-id": request_id, **fingerprint,
                                     **long_input_headers(report)})

        return await self._answer("embeddings", f"/v1/embeddings {request_id}", handle)

    @app.post("/embed")
    async def tei_embed(self, request: Request) -> Response:
        """Hugging Face TEI's /embed: the same engines, TEI's request and response shapes."""
        request_id = f"tei-{uuid.uuid4().hex[:16]}"

        async def handle(seen: dict[str, str]) -> Response:
            req = parse_tei_embed_request(
                await read_json_body(request, self.cfg.router.max_body_bytes))
            model = seen["model"] = req.model or self.cfg.models[0].name
            self._engine(model)
            self._check_count(len(req.inputs), "inputs")
            vectors, tokens, _, fingerprint, report = await self._embed(
                model, req.inputs, request_id, dimensions=req.dimensions,
                long_input=req.long_input_policy(self.cfg.model(model).long_input),
                prompt_name=req.prompt_name, normalize=req.normalize)
            self._count_served(model, vectors, tokens)
            return Response(tei_embed_response(vectors), media_type="application/json",
                            headers={"x-request-id": request_id, **fingerprint,
                                     **long_input_headers(report)})

        return await self._answer("embed", f"/embed {request_id}", handle)

    @app.post("/tokenize")
    async def tei_tokenize(self, request: Request) -> Response:
        """TEI's /tokenize with the model's own tokenizer (offsets into the input text)."""
        async def handle(seen: dict[str, str]) -> Response:
            req = parse_tei_tokenize_request(
                await read_json_body(request, self.cfg.router.max_body_bytes))
            model = seen["model"] = req.model or self.cfg.models[0].name
            tokens = await asyncio.wait_for(
                self._engine(model).tokenize_tei.remote(req.inputs, req.add_special_tokens,
                                                        req.prompt_name),
                timeout=self.cfg.router.request_timeout_s)
            return Response(tei_tokenize_response(tokens), media_type="application/json")

        return await self._answer("tokenize", "/tokenize", handle)

    @app.get("/v1/models")
    async def models(self) -> Response:
        snap = await self._snapshot()
        data = []
        for m in self.cfg.models:
            replicas = snap.get(m.name, [])
            first = replicas[0] if replicas else {}
            data.append({
                "id": m.name,
                "object": "model",
                "created": self.started,
                "owned_by": "embedfleet",
                "max_input_tokens": first.get("max_model_len", m.max_model_len),
                "dimensions": first.get("dimensions"),
                "matryoshka_dimensions": first.get("matryoshka_dimensions"),
                "replicas": {
                    "ready": sum(1 for r in replicas if r.get("ready")),
                    "min": m.replicas.min_replicas,
                    "max": m.replicas.max_replicas,
                    "cards": [{"node": r["node"], "device": r["device"],
                               "replica_id": r["replica_id"], "ready": r.get("ready"),
                               "budget": r.get("budget"), "memory": r.get("memory"),
                               "block_size": r.get("block_size"),
                               "prefix_cache": r.get("prefix_cache")}
                              for r in replicas],
                },
                "prefix_cache": first.get("prefix_cache", {"enabled": None,
                                                           "reason": "no replica up yet"}),
            })
        return Response(orjson.dumps({"object": "list", "data": data}),
                        media_type="application/json")

    @app.get("/health")
    async def health(self) -> Response:
        return Response(orjson.dumps({"status": "ok"}), media_type="application/json")

    @app.get("/ready")
    async def ready(self) -> Response:
        """200 while every model that must stay up (min_replicas >= 1) has a ready replica.

        A scale-to-zero model at zero is ready (its first request starts a replica); a model whose
        replicas cannot get a card says so under ``waiting``, whatever the status."""
        snap = await self._snapshot()
        counts = {m.name: sum(1 for r in snap.get(m.name, []) if r.get("ready"))
                  for m in self.cfg.models}
        waiting = await self._waiting_reasons()
        detail = {}
        for m in self.cfg.models:
            n = counts[m.name]
            state = ("serving" if n else "scaled to zero" if m.replicas.min_replicas == 0
                     else "starting")
            detail[m.name] = {"ready": n, "min": m.replicas.min_replicas,
                              "max": m.replicas.max_replicas,
                              "state": "waiting for a card" if m.name in waiting else state}
        missing = sorted(m.name for m in self.cfg.models
                         if counts[m.name] == 0 and m.replicas.min_replicas > 0)
        extra = {"models": counts, "detail": detail, "waiting": waiting}
        if missing:
            why = "; ".join(f"{n}: {waiting[n]}" for n in missing if n in waiting)
            err = NotReady(f"no ready replica for model(s): {', '.join(missing)}"
                           + (f" ({why})" if why else ""),
                           retry_after_s=self.cfg.router.retry_after_s)
            return Response(orjson.dumps({**err.body(), **extra}), status_code=503,
                            headers=err.headers(), media_type="application/json")
        return Response(orjson.dumps({"status": "ready", **extra}),
                        media_type="application/json")
