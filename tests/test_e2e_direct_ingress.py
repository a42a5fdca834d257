"""A one-model app whose engine replicas take HTTP themselves (``router.ingress: engine``).

The session cluster's app has five models, so it keeps its Router. This module deploys a second
app beside it, ``direct-e2e`` at ``/direct``: MiniLM alone, with the e2e config's MiniLM settings
(the same small admission budget) and its router limits, on the cluster's one card that is free
at steady state (tests/configs/e2e-cpu.yaml), and deletes it afterwards. Shown, through HAProxy:

* the app has no Router deployment: the engine deployment is its ingress;
* the OpenAI client gets MiniLM's vectors, and TEI's /embed the same ones;
* every bad request of ``test_e2e_errors.CASES`` gets the same status and OpenAI error as from
  the Router app (the model's name is the same in both);
* a burst past the replica's owner queue gets 429 + Retry-After with an OpenAI body, and every
  other request its vectors: admission is the replica's own, with no Router in front;
* ``/ready`` and ``/v1/models`` read the app's own registry, and its API key is required;
* the corpus job's call (``embed_batch`` through the app's handle) reaches the engine replica.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy

import numpy as np
import pytest
import requests
import yaml

from tests.conftest import E2E_TEMPLATE, MINILM
from tests.support.live_cluster import delete_app, ray_script, ray_script_json
from tests.test_e2e_errors import CASES

pytestmark = pytest.mark.cluster

APP, PREFIX = "direct-e2e", "/direct"

DEPLOY = """
import sys
import ray
from ray import serve
from embedfleet.deployments.app import build
from embedfleet.deployments.config.schema import load_config
from embedfleet.deployments.config.ray_options import RUNTIME_ENV_VARS

cfg = load_config(sys.argv[1])
assert cfg.direct_ingress, "the test app must resolve router.ingress to engine"
ray.init(address="auto", logging_level="ERROR", log_to_driver=False,
         runtime_env={"env_vars": RUNTIME_ENV_VARS})
serve.run(build(cfg), name=cfg.app_name, route_prefix=sys.argv[2])
print(" ".join(sorted(serve.status().applications[cfg.app_name].deployments)))
"""

EMBED_BATCH = """
import json, sys
import ray
from ray import serve
from embedfleet.deployments.common.contracts import BatchCall
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
res = serve.get_app_handle(sys.argv[1]).embed_batch.remote(
    BatchCall(sys.argv[2], json.loads(sys.argv[3]))).result()
print(json.dumps({"vectors": res.vectors.tolist(), "tokens": list(res.tokens),
                  "fingerprint": res.fingerprint}))
"""


KEY = "sk-direct-e2e-0123456789"  # keys have at least 16 characters (ingress/auth.py)
AUTH = {"Authorization": f"Bearer {KEY}"}


def direct_config(tmp_path) -> str:
    """The e2e config cut down to MiniLM, with router.ingress left at auto, and an API key."""
    data = yaml.safe_load(E2E_TEMPLATE.read_text())
    (minilm,) = [copy.deepcopy(m) for m in data["models"] if m["name"] == MINILM]
    minilm["replicas"] = {"min_replicas": 1, "max_replicas": 1}
    minilm["routing"] = {"policy": "power_of_two"}
    keep = ("platform", "router", "governor", "monitoring", "health_check_timeout_s",
            "health_stall_timeout_s")
    cfg = {"app_name": APP, "models": [minilm], **{k: data[k] for k in keep if k in data}}
    keys = tmp_path / "api-keys"
    keys.write_text(f"{KEY}\n")
    cfg["router"] = {**cfg["router"], "api_keys_file": str(keys)}
    path = tmp_path / "direct-e2e.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.fixture(scope="module")
def direct(cluster, tmp_path_factory):
    """The direct app's base URL (through the session cluster's HAProxy); its deployments."""
    path = direct_config(tmp_path_factory.mktemp("direct"))
    # the free card may still be held by minilm-autoscale's second replica for a few seconds
    deployments = ray_script(DEPLOY, path, PREFIX, timeout=600).split()
    yield f"{cluster}{PREFIX}", deployments
    delete_app(APP, wait=False)  # the next modules need no card; the governor's comes later


def test_the_engine_deployment_is_the_ingress(direct):
    _, deployments = direct
    assert deployments == ["FleetRegistry", "MemoryGovernor", f"engine-{MINILM}"], deployments


def test_openai_client_and_tei_get_minilm_vectors(direct, reference_embed):
    from openai import OpenAI

    url, _ = direct
    texts = ["the direct path", "no router in between", "HAProxy to the replica"]
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    raw = client.embeddings.with_raw_response.create(model=MINILM, input=texts)
    got = np.array([d.embedding for d in raw.parse().data], dtype=np.float32)
    want = reference_embed(texts)
    assert np.min(np.sum(got * want, axis=1)) >= 0.9999
    assert raw.headers["x-embedfleet-replicas"], raw.headers  # served by one replica of the app
    tei = requests.post(f"{url}/embed", json={"inputs": texts}, headers=AUTH, timeout=60)
    assert tei.status_code == 200, tei.text
    assert np.allclose(np.array(tei.json(), dtype=np.float32), got, atol=1e-5)


@pytest.mark.parametrize("raw, headers", [c[1:3] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_the_router_apps_error(cluster, direct, raw, headers):
    url, _ = direct
    via_router = requests.post(f"{cluster}/v1/embeddings", data=raw, headers=headers, timeout=60)
    direct_resp = requests.post(f"{url}/v1/embeddings", data=raw, headers={**headers, **AUTH},
                                timeout=60)
    assert direct_resp.status_code == via_router.status_code, direct_resp.text
    want, got = via_router.json()["error"], direct_resp.json()["error"]
    if want["code"] == "model_not_found":  # the message lists each app's own models
        want, got = {**want, "message": ""}, {**got, "message": ""}
    assert got == want


def test_a_burst_past_the_owner_queue_gets_429_and_the_rest_vectors(direct, reference_embed):
    """The e2e MiniLM admission (2,048 tokens in flight, 8 calls waiting): a call of 32 texts of
    ~60 tokens takes most of the budget, so of 48 concurrent calls at most ~10 fit."""
    url, _ = direct
    texts = [f"request text number {i} " + "with several more words " * 8 for i in range(32)]
    want = reference_embed(texts)

    def call(_: int) -> requests.Response:
        return requests.post(f"{url}/v1/embeddings", json={"model": MINILM, "input": texts},
                             headers=AUTH, timeout=300)

    with cf.ThreadPoolExecutor(48) as pool:
        answers = list(pool.map(call, range(48)))
    statuses = sorted({r.status_code for r in answers})
    assert set(statuses) <= {200, 429}, [r.text[:300] for r in answers if r.status_code >= 500]
    refused = [r for r in answers if r.status_code == 429]
    assert refused, "48 concurrent calls all fit a budget of 2,048 tokens + 8 waiting"
    for r in refused:
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] and r.json()["error"]["message"]
    for r in answers:
        if r.status_code == 200:
            got = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
            assert np.min(np.sum(got * want, axis=1)) >= 0.9999


def test_the_apps_api_key_is_required_by_the_engine_replica(direct):
    """The keys are the app's own (set on the FastAPI app Serve serves in the replica)."""
    url, _ = direct
    for headers in ({}, {"Authorization": "Bearer sk-wrong-0123456789"}):
        resp = requests.post(f"{url}/v1/embeddings", json={"model": MINILM, "input": "a"},
                             headers=headers, timeout=30)
        assert resp.status_code == 401, resp.text
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert requests.get(f"{url}/health", timeout=30).status_code == 200  # open, as documented


def test_ready_and_models_read_the_apps_own_registry(direct):
    url, _ = direct
    ready = requests.get(f"{url}/ready", headers=AUTH, timeout=30)
    assert ready.status_code == 200, ready.text
    assert ready.json()["models"] == {MINILM: 1}
    models = requests.get(f"{url}/v1/models", headers=AUTH, timeout=30).json()["data"]
    assert [m["id"] for m in models] == [MINILM]


def test_the_corpus_jobs_handle_call_reaches_the_engine_replica(direct, reference_embed):
    """``embedfleet embed-corpus`` calls the app's ingress handle (``serve.get_app_handle``):
    here the engine deployment's ``embed_batch``, on the bulk lane, through the same pipeline."""
    import json

    texts = ["a corpus passage", "another passage, a little longer than the first"]
    out = ray_script_json(EMBED_BATCH, APP, MINILM, json.dumps(texts))
    got = np.array(out["vectors"], dtype=np.float32)
    assert np.min(np.sum(got * reference_embed(texts), axis=1)) >= 0.9999
    assert all(n > 2 for n in out["tokens"])  # real token counts, [CLS] and [SEP] included
    assert out["fingerprint"]["x-embedfleet-engine"].startswith("vllm")
