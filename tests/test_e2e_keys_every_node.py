"""API keys travel with the deployment: an ingress replica on the second node enforces them.

The session cluster (tests/configs/e2e-cpu.yaml) is open on loopback. This module deploys two
more Router apps beside it, each with its Router replicas pinned to the cluster's second node
(``local-node-1``, by Ray's ``ray.io/node-id`` label), a node whose `ray start` environment
holds no key:

* ``keys-e2e`` at ``/keys-e2e`` names a keys file in its config: through the session's HAProxy
  (on the head) every request reaches a Router replica on the second node, which answers 401
  without the key or with a wrong one, and serves the key's holder;
* ``keys-missing-e2e`` names an environment variable no node has: its Router replicas must not
  start (the app ends DEPLOY_FAILED) and its prefix never answers 200 — fail closed, never open.

Only scale-to-zero models, so neither app takes a card.
"""

from __future__ import annotations

import copy
import json

import pytest
import requests
import yaml

from tests.conftest import E2E_TEMPLATE, ZERO
from tests.support.live_cluster import actors_of_class, delete_app, ray_script_json, wait_for

pytestmark = pytest.mark.cluster

APP, MISSING = "keys-e2e", "keys-missing-e2e"
SECOND_NODE = "local-node-1"  # cluster/local.py local_node_name(1)
KEY = "sk-keys-e2e-0123456789abcdef"
UNSET_ENV = "EMBEDFLEET_E2E_KEYS_ON_NO_NODE"

# The app as `deployments/app.py:build` binds a Router app, with the Router's replicas pinned
# to one node (Serve's ray_actor_options.label_selector). argv[4] "wait": the app must run;
# "nowait": it may end DEPLOY_FAILED. Prints the app's final status as JSON.
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
node_name, prefix, wait = sys.argv[2], sys.argv[3], sys.argv[4] == "wait"
ray.init(address="auto", logging_level="ERROR", log_to_driver=False,
         runtime_env={"env_vars": RUNTIME_ENV_VARS})
(node,) = [n for n in ray.nodes() if n["Alive"] and n["NodeName"] == node_name]
assert node.get("Labels", {}).get("ray.io/node-id") == node["NodeID"], node.get("Labels")
data = config_to_data(cfg)
registry = serve.deployment(FleetRegistry).options(**registry_deployment_options(cfg)).bind(data)
governor = serve.deployment(MemoryGovernor).options(**governor_deployment_options(cfg)).bind(data)
engines = {m.name: serve.deployment(EngineReplica).options(
    **engine_deployment_options(cfg, m)).bind(data, m.name, registry, DEFAULT_ENGINE_FACTORY,
                                              governor) for m in cfg.models}
opts = router_deployment_options(cfg)
opts["ray_actor_options"] = {**opts["ray_actor_options"],
                             "label_selector": {"ray.io/node-id": node["NodeID"]}}
app = serve.deployment(mount_routes(new_api(), Router)).options(**opts).bind(
    data, engines, registry, governor)
try:  # serve.run returns once the app runs, and raises when it ends DEPLOY_FAILED
    serve.run(app, name=cfg.app_name, route_prefix=prefix)
except RuntimeError:
    if wait:
        raise
status = serve.status().applications[cfg.app_name]
router = status.deployments.get("Router")
states = {getattr(k, "value", str(k)): n
          for k, n in (router.replica_states if router else {}).items()}
print(json.dumps({"status": getattr(status.status, "value", status.status),
                  "message": status.message,
                  "router_message": router.message if router else "",
                  "router_replicas": states}))
"""

def app_config(tmp_path, name: str, **router) -> str:
    """The e2e config cut down to its scale-to-zero model, behind a Router with ``router``."""
    data = yaml.safe_load(E2E_TEMPLATE.read_text())
    (zero,) = [copy.deepcopy(m) for m in data["models"] if m["name"] == ZERO]
    keep = ("platform", "governor", "monitoring", "health_check_timeout_s",
            "health_stall_timeout_s")
    cfg = {"app_name": name, "models": [zero], **{k: data[k] for k in keep if k in data},
           "router": {**data["router"], "ingress": "router", **router}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def router_nodes(app: str) -> list[str]:
    actors, node_name = actors_of_class(f"ServeReplica:{app}:Router")
    return sorted(node_name.get(a.node_id, a.node_id) for a in actors if a.state == "ALIVE")


@pytest.fixture(scope="module")
def keyed(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keys")
    keys = tmp / "api-keys"
    keys.write_text(f"# the e2e key\n{KEY}\n")
    path = app_config(tmp, APP, api_keys_file=str(keys))
    status = ray_script_json(DEPLOY, path, SECOND_NODE, f"/{APP}", "wait", timeout=600)
    yield f"{cluster}/{APP}", status
    delete_app(APP, wait=False)  # its Routers' graceful stop need not hold up the next modules


def test_every_router_replica_of_the_app_is_on_the_second_node(keyed):
    _, status = keyed
    assert status["status"] == "RUNNING", status
    assert router_nodes(APP) == [SECOND_NODE, SECOND_NODE]  # router.replicas: 2


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-wrong-0123456789abcdef"},
                                     {"Authorization": f"Basic {KEY}"}],
                         ids=["no-key", "wrong-key", "not-bearer"])
def test_the_second_nodes_replica_refuses_without_the_key(keyed, headers):
    url, _ = keyed
    for path in ("/ready", "/v1/models", "/v1/embeddings"):
        resp = requests.request("POST" if path == "/v1/embeddings" else "GET", f"{url}{path}",
                                json={"model": ZERO, "input": "a"}, headers=headers, timeout=30)
        assert resp.status_code == 401, (path, resp.text)
        err = resp.json()["error"]
        assert (err["type"], err["code"]) == ("authentication_error", "invalid_api_key")


def test_the_second_nodes_replica_serves_the_key_holder(keyed):
    url, _ = keyed
    auth = {"Authorization": f"Bearer {KEY}"}
    ready = requests.get(f"{url}/ready", headers=auth, timeout=60)
    assert ready.status_code == 200, ready.text
    models = requests.get(f"{url}/v1/models", headers=auth, timeout=60)
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == [ZERO]
    assert requests.get(f"{url}/health", timeout=30).status_code == 200  # open, as documented


def test_a_replica_that_finds_no_keys_never_starts_and_never_serves_open(cluster,
                                                                        tmp_path_factory):
    path = app_config(tmp_path_factory.mktemp("keys-missing"), MISSING, api_keys_env=UNSET_ENV)
    try:
        status = ray_script_json(DEPLOY, path, SECOND_NODE, f"/{MISSING}", "nowait",
                                 timeout=600)
        assert status["status"] == "DEPLOY_FAILED", status
        assert UNSET_ENV in status["router_message"], status  # the replica's own reason
        # Serve goes on retrying a failed replica with backoff, so an actor may be alive in its
        # constructor at any moment; what must never be is a replica that finished starting.
        assert status["router_replicas"].get("RUNNING", 0) == 0, status
        for route in ("/ready", "/v1/models"):
            resp = requests.get(f"{cluster}/{MISSING}{route}", timeout=30)
            assert resp.status_code != 200, resp.text
    finally:
        delete_app(MISSING)
    wait_for(lambda: router_nodes(MISSING) == [], 120, f"{MISSING}'s Router replicas gone")
