"""A one-model app's engine replica that takes HTTP itself: the Router hop taken out.

With ``router.ingress`` resolved to ``engine`` (one model, an embedder or a reranker, always
at least one replica, no prefix-affinity routing over more than one replica), the engine
deployment is the app's ingress: HAProxy (or Serve's proxy)
hands each request to a replica, and the replica runs the same ``ApiRoutes`` and ``EmbedPipeline``
as the Router, with its own request path as the model's only caller. What the Router did besides
that, and where it went:

* choosing a replica: HAProxy's least-connections (each replica is one of its servers);
* admission: the replica's own owner queue (429 + Retry-After), as before, and the Router's
  share check, sized so Serve never rejects an embedding request in plain text itself
  (``options.direct_model_share``);
* the bound on a request's time (``options.request_bound_s``, the Router's): 503 +
  Retry-After past it;
* holding calls through an engine swap: the replica's engine gate, as before; a replica that
  is starting gets no HTTP until it is ready;
* a replica whose engine died: HAProxy replays requests whose connection it closed
  (``options.HAPROXY_REPLAY_ENV``); a request the dead engine held gets 503 + Retry-After from
  its replica (the Router would have retried it on another replica);
* ``/ready``, ``/v1/models``: the registry's view of the fleet, as the Router's.

The deployment holds its replica (``EngineReplica``, built and started as the plain engine
deployment's) beside the routes: it is not a kind of replica. It answers every call Serve and the
fleet make of an engine replica (``check_health``, ``describe``, ``record_routing_stats``,
``embed``, ``rerank``, ``tokenize_tei``) by handing it to the replica it holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI

from .router import ApiIngress, FleetView, mount_routes, new_api, serve_api_keys
from .routes import ApiRoutes
from ..config.schema import parse_config
from ..common.contracts import EmbedCall, EmbedResult, Lane, ReplicaDescription
from ..engine.lifecycle import DEFAULT_ENGINE_FACTORY
from ..common.errors import EngineUnavailable
from ..config.ray_options import direct_model_share, request_bound_s
from ..replica.engine_replica import EngineReplica
from ..replica.rerank_path import RerankCall, RerankResult
from .pipeline import EmbedPipeline

T = TypeVar("T")


class DirectEngine(ApiIngress):
    """The HTTP routes in front of one ``EngineReplica``'s own request path, which it holds.
    Deployed as ``direct_deployment()`` (``mount_routes(new_api(), DirectEngine)``)."""

    async def __init__(self, config: dict[str, Any], model_name: str, registry: Any = None,
                       engine_factory: str = DEFAULT_ENGINE_FACTORY, governor: Any = None) -> None:
        cfg = parse_config(config, "direct ingress args")
        # Keys first: a replica that must fail closed (keys named, none here) fails before it
        # loads an engine for minutes.
        serve_api_keys(self._app, cfg)
        self.replica = EngineReplica.built(cfg, model_name, registry=registry,
                                           governor=governor, engine_factory=engine_factory)
        await self.replica.start()
        m = cfg.model(model_name)
        self._retry_after_s = cfg.router.retry_after_s
        # A call's bound, as the Router's: a request never outlives it (a paused engine).
        self._bound_s = request_bound_s(cfg.router, m)
        pipeline = EmbedPipeline(cfg, {model_name: self._bounded_embed},
                                 share=direct_model_share(m))
        self.api = ApiRoutes(cfg, pipeline, FleetView(registry).status, self._tokenize,
                             self.replica.recorder)
        if m.task == "rerank":  # the rerank routes' one caller, bounded the same way
            self.api.rerank.callers[model_name] = self._bounded_rerank

    async def _bounded_embed(self, call: EmbedCall) -> EmbedResult:
        """The model's one caller: the replica's own request path (``EngineReplica.embed``),
        within the bound; past it, 503 + Retry-After."""
        return await self._bounded(self.replica.embed(call))

    async def _bounded(self, call: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(call, self._bound_s)
        except asyncio.TimeoutError:
            raise EngineUnavailable(
                f"replica {self.replica.replica_id} did not answer within {self._bound_s:g}s",
                retry_after_s=self._retry_after_s) from None

    async def _bounded_rerank(self, call: RerankCall) -> RerankResult:
        return await self._bounded(self.replica.rerank(call))

    async def _tokenize(self, model: str, texts: list[str], add_special_tokens: bool,
                        prompt_name: str | None, lane: Lane) -> list:
        return await self.replica.tokenize_tei(texts, add_special_tokens, prompt_name, lane)

    # -- what Serve and the fleet call on an engine replica: its replica's answers ------------
    async def embed(self, call: EmbedCall) -> EmbedResult:
        return await self.replica.embed(call)

    async def rerank(self, call: RerankCall) -> RerankResult:
        return await self.replica.rerank(call)

    async def tokenize_tei(self, texts: list[str], add_special_tokens: bool = True,
                           prompt_name: str | None = None, lane: Lane = "interactive") -> list:
        return await self.replica.tokenize_tei(texts, add_special_tokens, prompt_name, lane)

    def describe(self) -> ReplicaDescription:
        return self.replica.describe()

    def record_routing_stats(self) -> dict[str, Any]:
        return self.replica.record_routing_stats()

    async def check_health(self) -> None:
        await self.replica.check_health()

    def __del__(self) -> None:
        replica = getattr(self, "replica", None)
        if replica is not None:
            replica.stop()


def direct_deployment(app: FastAPI | None = None) -> type:
    """The engine deployment class of a one-model app that takes HTTP (a new FastAPI app each
    call, as the Router gets from ``mount_routes``)."""
    return mount_routes(new_api() if app is None else app, DirectEngine)
