"""The Serve-handle API (``embed_batch``, what `embed-corpus` calls) passes the row's long-input
choices to the same pipeline as HTTP: ``chunk_above`` included, so a refused value is the same
400 and an accepted one reaches the replica's call."""

from __future__ import annotations

import asyncio

import pytest

from embedfleet.deployments.common import metrics
from embedfleet.deployments.common.contracts import BatchCall
from embedfleet.deployments.common.errors import EmbedfleetError
from embedfleet.deployments.ingress.pipeline import EmbedPipeline
from embedfleet.deployments.ingress.routes import ApiRoutes
from tests.support.router_app import MODEL, one_model_config, standin_replicas, standin_tokenize


def routes(seen: list) -> ApiRoutes:
    cfg = one_model_config()

    async def caller(call):
        seen.append(call)
        return await standin_replicas(call)

    async def no_status():
        raise AssertionError("not used")

    return ApiRoutes(cfg, EmbedPipeline(cfg, {MODEL: caller}), no_status, standin_tokenize,
                     metrics.Batched())


def test_chunk_above_reaches_the_replicas_call_in_chunk_mode():
    seen: list = []
    out = asyncio.run(routes(seen).embed_batch(
        BatchCall(MODEL, ["a text"], long_input="chunk", chunk_above="always")))
    assert out.vectors.shape[0] == 1
    (call,) = seen
    assert call.long_input is not None and call.long_input.mode == "chunk"
    assert call.long_input.chunk_above == "always"


def test_chunk_above_outside_chunk_mode_is_the_same_400_as_http():
    seen: list = []
    with pytest.raises(EmbedfleetError) as err:
        asyncio.run(routes(seen).embed_batch(
            BatchCall(MODEL, ["a text"], long_input="truncate", chunk_above="always")))
    assert err.value.status == 400 and err.value.param == "chunk_above"
    assert seen == []
