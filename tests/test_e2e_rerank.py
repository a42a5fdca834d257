"""Rerank end to end: a reranker app deployed beside the session one, through HTTP.

The session cluster (tests/configs/e2e-cpu.yaml) serves embedders only, and changing it would
change every e2e test's cluster; so this module deploys its own small Router app
(``rerank-e2e`` at ``/rerank-e2e``) as tests/test_e2e_keys_every_node.py does: the tiny
random-weight Qwen3 reranker built at test time (one card: the session leaves one of its six
free) and the session's scale-to-zero MiniLM (no card until asked). Its ``rerank.canary`` triple
is fixed by transformers' reference scores of the same model (random weights know no relevance).

* every rerank route's scores equal transformers' reference (p("yes") over no/yes at the last
  token of the template-rendered pair) to 1e-3, in each route's shape (plain HTTP against the
  documented shapes: the ``cohere`` SDK is not installed here);
* an embedding model asked to rerank and the reranker asked to embed are 400s that say so;
* the same reranker whose engine gets swapped classifier tokens (a wrong override, past the
  config through the test's engine factory) fails its ordering canary: the app ends
  DEPLOY_FAILED with the canary's reason and never answers 200.
"""

from __future__ import annotations

import copy
import json

import pytest
import requests
import yaml

from embedfleet.benchmarks.tiny_qwen3_reranker import CANARY_DOCS, CANARY_QUERY, reference_triple
from embedfleet.deployments.config.ray_options import engine_deployment_name
from embedfleet.deployments.engine.rerank_models import FAMILIES
from tests.conftest import E2E_TEMPLATE, ZERO
from tests.support.live_cluster import actors_of_class, delete_app, ray_script_json, wait_for
from tests.support.tiny_qwen3_reranker import build_tiny_qwen3_reranker
from tests.support.wrong_override import FACTORY as WRONG_FACTORY

pytestmark = pytest.mark.cluster

APP, WRONG_APP = "rerank-e2e", "rerank-wrong-e2e"
RERANKER = "tiny-qwen3-reranker"
QUERY, DOCS = CANARY_QUERY, list(CANARY_DOCS)

# `deployments/app.py:build`'s Router app, with one engine factory for every model (argv[3]:
# "default" or a factory path). argv[4] "wait": the app must run; "nowait": it may end
# DEPLOY_FAILED. Prints the app's final status as JSON.
DEPLOY = """
import json, sys
import ray
from ray import serve
from embedfleet.deployments.ingress.router import Router, mount_routes, new_api
from embedfleet.deployments.config.schema import config_to_data, load_config
from embedfleet.deployments.fleet.governor import MemoryGovernor
from embedfleet.deployments.fleet.registry import FleetRegistry
from embedfleet.deployments.engine.lifecycle import DEFAULT_ENGINE_FACTORY
from embedfleet.deployments.config.ray_options import (RUNTIME_ENV_VARS, engine_deployment_options,
    governor_deployment_options, registry_deployment_options, router_deployment_options)
from embedfleet.deployments.replica.engine_replica import EngineReplica

cfg = load_config(sys.argv[1])
prefix, factory, wait = sys.argv[2], sys.argv[3], sys.argv[4] == "wait"
factory = DEFAULT_ENGINE_FACTORY if factory == "default" else factory
ray.init(address="auto", logging_level="ERROR", log_to_driver=False,
         runtime_env={"env_vars": RUNTIME_ENV_VARS})
data = config_to_data(cfg)
registry = serve.deployment(FleetRegistry).options(**registry_deployment_options(cfg)).bind(data)
governor = serve.deployment(MemoryGovernor).options(**governor_deployment_options(cfg)).bind(data)
# "nowait": the replica is expected to fail its start; one failed start is the proof, so Serve
# is not left to retry a reranker's whole engine start (a minute each here) before DEPLOY_FAILED.
retries = {} if wait else {"max_constructor_retry_count": 1}
engines = {m.name: serve.deployment(EngineReplica).options(
    **engine_deployment_options(cfg, m), **retries).bind(data, m.name, registry, factory,
                                                          governor)
    for m in cfg.models}
app = serve.deployment(mount_routes(new_api(), Router)).options(
    **router_deployment_options(cfg)).bind(data, engines, registry, governor)
try:  # serve.run returns once the app runs, and raises when it ends DEPLOY_FAILED
    serve.run(app, name=cfg.app_name, route_prefix=prefix)
except RuntimeError:
    if wait:
        raise
status = serve.status().applications[cfg.app_name]
engine = status.deployments.get(sys.argv[5]) if len(sys.argv) > 5 else None
print(json.dumps({"status": getattr(status.status, "value", status.status),
                  "message": status.message,
                  "engine_message": engine.message if engine else ""}))
"""

def _reference() -> tuple[list[float], dict[str, str]]:
    """Transformers' scores of DOCS, and the canary triple they fix (best and worst document),
    with the ids the engine tokenises them to (the same tokenizer, special tokens included)."""
    return reference_triple(build_tiny_qwen3_reranker(), FAMILIES[0].template, QUERY, DOCS)


def app_config(tmp_path, name: str, triple: dict[str, str]) -> str:
    data = yaml.safe_load(E2E_TEMPLATE.read_text())
    (zero,) = [copy.deepcopy(m) for m in data["models"] if m["name"] == ZERO]
    reranker = {"name": RERANKER, "task": "rerank",
                "source": {"path": str(build_tiny_qwen3_reranker())}, "max_model_len": 1024,
                "engine": {"max_num_batched_tokens": 4096, "kv_cache_memory_bytes": 33554432},
                "replicas": {"min_replicas": 1, "max_replicas": 1, "cold_start_hold_s": 900},
                "rerank": {"canary": triple}}
    keep = ("platform", "governor", "monitoring", "health_check_timeout_s",
            "health_stall_timeout_s")
    cfg = {"app_name": name, "models": [reranker, zero],
           **{k: data[k] for k in keep if k in data},
           "router": {**data["router"], "ingress": "router"}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _gone(app: str) -> bool:
    actors, _ = actors_of_class(f"ServeReplica:{app}:{engine_deployment_name(RERANKER)}")
    return not [a for a in actors if a.state == "ALIVE"]


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.fixture(scope="module")
def served(cluster, tmp_path_factory, reference):
    _, triple = reference
    path = app_config(tmp_path_factory.mktemp("rerank"), APP, triple)
    status = ray_script_json(DEPLOY, path, f"/{APP}", "default", "wait", timeout=1800)
    assert status["status"] == "RUNNING", status
    yield f"{cluster}/{APP}"
    delete_app(APP)
    wait_for(lambda: _gone(APP), 180, f"{APP}'s engine replicas gone")  # its card is free again


def _post(url: str, body: dict) -> requests.Response:
    return requests.post(url, json=body, timeout=600)


def test_tei_rerank_equals_the_reference(served, reference):
    want, _ = reference
    r = _post(f"{served}/rerank", {"query": QUERY, "texts": DOCS, "return_text": True,
                                   "model": RERANKER})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [x["index"] for x in body] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    for x in body:
        assert abs(x["score"] - want[x["index"]]) <= 1e-3 and x["text"] == DOCS[x["index"]]
    assert r.headers["x-embedfleet-prefix-cache"] in ("on", "off")


@pytest.mark.parametrize("route", ["/v1/rerank", "/v2/rerank"])
def test_rerank_api_equals_the_reference(served, reference, route):
    want, _ = reference
    r = _post(f"{served}{route}", {"model": RERANKER, "query": QUERY, "documents": DOCS,
                                   "top_n": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == RERANKER and body["usage"]["prompt_tokens"] > 0
    results = body["results"]
    assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])[:3]
    for x in results:
        assert abs(x["relevance_score"] - want[x["index"]]) <= 1e-3
        assert x["document"]["text"] == DOCS[x["index"]]


def test_score_equals_the_reference(served, reference):
    want, _ = reference
    r = _post(f"{served}/score", {"model": RERANKER, "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    got = [d["score"] for d in r.json()["data"]]
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-3


def test_roles_are_400(served):
    r = _post(f"{served}/v1/rerank", {"model": ZERO, "query": "q", "documents": ["d"]})
    assert r.status_code == 400 and "is an embedding model" in r.json()["error"]["message"]
    r = _post(f"{served}/v1/embeddings", {"model": RERANKER, "input": "x"})
    assert r.status_code == 400 and "is a reranker" in r.json()["error"]["message"]


def test_a_wrong_override_fails_the_canary_and_is_not_served(served, tmp_path_factory,
                                                              reference):
    # after `served`'s tests: its card is taken until it is deleted, so delete it first; the
    # wrong app's Router, registry and governor start while it stops, and its reranker replica
    # waits in Serve's scheduler for the card
    delete_app(APP, wait=False)
    _, triple = reference
    path = app_config(tmp_path_factory.mktemp("rerank-wrong"), WRONG_APP, triple)
    try:
        status = ray_script_json(DEPLOY, path, f"/{WRONG_APP}", WRONG_FACTORY, "nowait",
                                 engine_deployment_name(RERANKER), timeout=1800)
        assert status["status"] == "DEPLOY_FAILED", status
        assert "orders it wrong" in json.dumps(status), status
        r = _post(f"{served.rsplit('/', 1)[0]}/{WRONG_APP}/v1/rerank",
                  {"model": RERANKER, "query": QUERY, "documents": DOCS})
        assert r.status_code != 200, r.text
    finally:
        delete_app(WRONG_APP, wait=False)  # the modules after this one need no free card
