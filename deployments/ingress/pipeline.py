"""The one embed pipeline behind every API adapter: resolve the model, check the request against
it, slice it over the model's replicas, call them, merge.

Adapters (``ingress/openai.py``, ``ingress/tei.py``) only translate their wire shapes to an
``EmbedRequest`` and the ``Embedded`` result back, so the same bad input gets the same error on
both. Each model is reached through a ``Caller``: a Serve handle to its replicas, with the
bounded hold and the retry of a call whose replica died (``ingress/remote.py``).

A request's slices run as one task group: the first slice that fails (413 past its token bound,
429, 503) cancels its siblings, and the cancel reaches their replicas (``RemoteCaller``), so no
card keeps working for a request already answered with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ..common import metrics
from ..config.schema import EmbedfleetConfig, ModelConfig
from ..common.contracts import (EmbedCall, EmbedResult, InputReport, Lane,
                         merged_headers)
from ..common.errors import (InvalidParameterValue, ModelNotFound, Overloaded,
                      RequestTooLarge, TooManyInputs, clip)
from ..config.ray_options import router_model_share
from ..common.long_input import LongInputPolicy

logger = logging.getLogger("embedfleet.pipeline")

# Inputs per engine call: large requests are sliced so that several replicas work on them at once,
# while each slice stays big enough for the engine to batch well.
SLICE_INPUTS = 128
BULK_ROUTER_SHARE = 0.5  # of a model's router share (see EmbedPipeline.__init__)

Caller = Callable[[EmbedCall], Awaitable[EmbedResult]]
# Which replicas served the request (Serve replica ids): per-replica load and cache hits are
# visible to a client, e.g. the prefix-affinity bench. Not part of the vectors' fingerprint.
REPLICAS_HEADER = "x-embedfleet-replicas"


@dataclass(frozen=True, slots=True)
class EmbedRequest:
    """An embedding request whatever API it came through."""

    model: str
    inputs: list[str] | list[list[int]]
    param: str  # the adapter's name for the inputs ("input", "inputs"), for error messages
    dimensions: int | None = None
    long_input_mode: str | None = None  # None: the model's configured mode
    truncation_direction: str | None = None
    chunk_above: str | None = None  # None: the model's configured policy
    prompt_name: str | None = None
    task: str | None = None
    normalize: bool = True
    lane: Lane = "interactive"


@dataclass(frozen=True, slots=True)
class Embedded:
    vectors: np.ndarray  # (inputs, dimensions) float32, in input order
    prompt_tokens: int
    cached_tokens: int
    inputs: tuple[InputReport, ...]
    headers: dict[str, str]  # fingerprint and long-input counts


def long_input_headers(report: tuple[InputReport, ...]) -> dict[str, str]:
    """Counts of what the long-input policy did, as headers (for TEI clients too)."""
    return {"x-embedfleet-truncated-inputs": str(sum(1 for r in report if r.truncated)),
            "x-embedfleet-chunked-inputs": str(sum(1 for r in report if r.chunks > 1))}


def request_policy(default: LongInputPolicy, req: EmbedRequest) -> LongInputPolicy | None:
    """The request's long-input overrides on the model's policy (None: nothing overridden).
    Chunk sizes and the total bound always come from the model's configuration. A request's
    ``chunk_above`` only means something in chunk mode: elsewhere it is a 400, not ignored."""
    update = {k: v for k, v in (("mode", req.long_input_mode),
                                 ("truncation_direction", req.truncation_direction),
                                 ("chunk_above", req.chunk_above)) if v}
    policy = default.model_copy(update=update) if update else None
    if req.chunk_above and (policy or default).mode != "chunk":
        raise InvalidParameterValue(
            f"chunk_above applies to chunked inputs; this request's long-input mode is "
            f"{(policy or default).mode!r} (ask for long_input=chunk, or drop chunk_above)",
            param="chunk_above")
    return policy


def check_request_size(cfg: EmbedfleetConfig, m: ModelConfig, inputs: list, param: str) -> None:
    """The bounds a request's body decides before anything is tokenised, for every route: the
    number of inputs (422), their characters (text) or tokens (token ids) against the model's
    ``limits`` (413). Token counts of text are checked at the replica, once tokenised."""
    limit = cfg.router.max_inputs_per_request
    if len(inputs) > limit:
        raise TooManyInputs(f"{param} has {len(inputs)} items; at most {limit} per request",
                            param=param)
    if not inputs:
        return
    if isinstance(inputs[0], str):
        chars, bound = sum(len(t) for t in inputs), m.max_request_chars
        if chars > bound:
            raise RequestTooLarge(
                f"{param} has {chars} characters in all, more than model '{m.name}''s "
                f"limits.max_chars of {bound}; split it over several requests", param=param)
        return
    tokens, bound = sum(len(ids) for ids in inputs), m.max_request_tokens
    if tokens > bound:
        raise RequestTooLarge(
            f"{param} has {tokens} tokens in all, more than model '{m.name}''s "
            f"limits.max_tokens of {bound}; split it over several requests", param=param)


async def call_all(caller: Caller, calls: list[EmbedCall]) -> list[EmbedResult]:
    """Every slice at once, in order; the first to fail cancels the others and is raised as
    itself (a typed error keeps its status), not as an exception group."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(caller(c)) for c in calls]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [t.result() for t in tasks]


class EmbedPipeline:
    def __init__(self, cfg: EmbedfleetConfig, callers: dict[str, Caller],
                 share: int | None = None) -> None:
        """``share``: requests one model may hold at once (None: its share of the Router)."""
        self.cfg = cfg
        self._callers = callers
        self._models = {m.name: m for m in cfg.models}
        self._share = (router_model_share(len(callers), cfg.router.max_model_share)
                       if share is None else share)
        # Bulk may hold at most this much of a model's share, so a bulk flood held in the
        # replicas' bulk queues never takes the router slots interactive queries need.
        self._bulk_share = max(1, int(BULK_ROUTER_SHARE * self._share))
        self._inflight = dict.fromkeys(callers, 0)
        self._bulk_inflight = dict.fromkeys(callers, 0)

    @property
    def models(self) -> list[str]:
        return list(self._models)

    def resolve(self, name: str) -> ModelConfig:
        m = self._models.get(name)
        if m is None or name not in self._callers:
            known = ", ".join(sorted(self._callers))
            raise ModelNotFound(f"model {clip(name)} does not exist; served models: {known}",
                                param="model")
        return m

    def check(self, req: EmbedRequest) -> ModelConfig:
        """Every check that depends on the model or the router's limits, in one order for every
        API: the model exists (404), then the request's size (422, 413)."""
        m = self.resolve(req.model)
        if m.task == "rerank":
            raise InvalidParameterValue(
                f"model '{m.name}' is a reranker (task: rerank); it does not embed: send pairs "
                "to /rerank, /v1/rerank, /v2/rerank or /score", param="model")
        check_request_size(self.cfg, m, req.inputs, req.param)
        if req.task and req.inputs and isinstance(req.inputs[0], str):
            # the instruction's task text is copied into every input at the replica
            chars = sum(len(t) for t in req.inputs) + len(req.task) * len(req.inputs)
            if chars > m.max_request_chars:
                raise RequestTooLarge(
                    f"task x {len(req.inputs)} inputs makes {chars} characters in all, more "
                    f"than model '{m.name}''s limits.max_chars of {m.max_request_chars}",
                    param="task")
        return m


    @contextlib.contextmanager
    def held(self, model: str, lane: Lane) -> Iterator[None]:
        """One request of ``model`` in its router share while the block runs; past the share
        (or bulk's part of it), 429 + Retry-After. Every route that calls a model's replicas
        holds it (embeddings here, rerank in ``ingress/rerank.py``): one model's clients cannot
        take the router from the others whatever route they call."""
        bulk = lane == "bulk"
        if self._inflight[model] >= self._share or (
                bulk and self._bulk_inflight[model] >= self._bulk_share):
            metrics.get("embedfleet_overload_rejections_total").inc(
                1, tags={"model": model, "reason": "router_share"})
            wait = self.cfg.router.retry_after_s
            what, n = ("bulk requests", self._bulk_share) if bulk else ("requests", self._share)
            raise Overloaded(f"model '{model}' already has {n} {what} in the router, its "
                             f"share; retry after {wait}s", retry_after_s=wait)
        self._inflight[model] += 1
        self._bulk_inflight[model] += bulk
        try:
            yield
        finally:
            self._inflight[model] -= 1
            self._bulk_inflight[model] -= bulk

    async def run(self, req: EmbedRequest, request_id: str) -> Embedded:
        m = self.check(req)
        with self.held(req.model, req.lane):
            return await self._run(m, req, request_id)

    async def _run(self, m: ModelConfig, req: EmbedRequest, request_id: str) -> Embedded:
        caller = self._callers[req.model]
        policy = request_policy(m.long_input, req)
        slices = [req.inputs[i:i + SLICE_INPUTS] for i in range(0, len(req.inputs), SLICE_INPUTS)]
        calls = [EmbedCall(list(s), f"{request_id}-{k}", req.model, req.dimensions, policy,
                           req.prompt_name, req.task, req.normalize, req.lane)
                 for k, s in enumerate(slices)]
        results = [await caller(calls[0])] if len(calls) == 1 else await call_all(caller, calls)
        vectors = (results[0].vectors if len(results) == 1
                   else np.concatenate([r.vectors for r in results]))
        reports = tuple(InputReport(k * SLICE_INPUTS + r.index, r.truncated, r.dropped_tokens,
                                    r.chunks, r.input_tokens)
                        for k, res in enumerate(results) for r in res.inputs)
        headers = {**merged_headers([r.fingerprint for r in results]),
                   **long_input_headers(reports),
                   REPLICAS_HEADER: ",".join(sorted({r.replica_id for r in results}))}
        return Embedded(vectors, sum(r.prompt_tokens for r in results),
                        sum(r.cached_tokens for r in results), reports, headers)
