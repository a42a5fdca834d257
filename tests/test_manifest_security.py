"""The rendered 910B clusters are closed: every manifest has Ray's token auth, no public
dashboard, the API keys from a Secret (KubeRay) or a synced file (launcher), read-only weights,
pod security, a NetworkPolicy, and GCS fault tolerance. Schema-level: nothing starts Kubernetes.
"""

from __future__ import annotations

import shlex
from pathlib import PurePosixPath

import pytest
import yaml

from embedfleet.cluster.manifest_kuberay import kuberay_manifests
from embedfleet.cluster.manifest_security import (DASHBOARD_AGENT_PORT, KEYS_FILE_IN_POD,
                                                  KEYS_MOUNT_DIR, RAY_TOKEN_FILE,
                                                  REDIS_PASSWORD_FILE, pod_labels)
from embedfleet.cluster.manifest_spec import (CLIENT_PORT, DASHBOARD_PORT, HEAD_PORT,
                                              METRICS_PORT, cluster_spec)
from embedfleet.cluster.manifests import (ASCEND_910B_CONFIG, example_files,
                                          render_cluster_launcher, render_rayservice)
from embedfleet.deployments.config.schema import ConfigError, load_config, parse_config

ASCEND = load_config(ASCEND_910B_CONFIG)
EXAMPLE = cluster_spec(ASCEND, example=True)


def _ascend(router: dict | None = None, cluster: dict | None = None):
    data = yaml.safe_load(ASCEND_910B_CONFIG.read_text())
    if router is not None:
        data["router"] = router
    if cluster is not None:
        data["cluster"] = cluster
    return parse_config(data)


def _kuberay(cfg=ASCEND, spec=None) -> dict[str, list[dict]]:
    """The documents of `render --kuberay`, by kind (parsed from the rendered text)."""
    out: dict[str, list[dict]] = {}
    for doc in yaml.safe_load_all(render_rayservice(cfg, spec or cluster_spec(cfg,
                                                                              example=True))):
        out.setdefault(doc["kind"], []).append(doc)
    return out


def _pods(svc: dict) -> list[dict]:
    ray = svc["spec"]["rayClusterConfig"]
    return [ray["headGroupSpec"]["template"], ray["workerGroupSpecs"][0]["template"]]


def _serve_router(svc: dict) -> dict:
    return yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"][0]["args"]["config"][
        "router"]


def _under(path: str, folder: str) -> bool:
    return folder == path or PurePosixPath(folder) in PurePosixPath(path).parents


@pytest.fixture(scope="module")
def kuberay() -> dict[str, list[dict]]:
    return _kuberay()


@pytest.fixture(scope="module")
def launcher() -> dict:
    return yaml.safe_load(render_cluster_launcher(ASCEND, EXAMPLE))


# -- every rendered manifest ----------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(example_files()))
def test_no_rendered_file_puts_the_dashboard_on_every_interface_of_a_host(name):
    """KubeRay's head is a pod (its interfaces are the pod network's, see the NetworkPolicy
    tests); a host-level `ray start` never binds the dashboard to 0.0.0.0."""
    text = example_files()[name]
    assert "--dashboard-host=0.0.0.0" not in text


# -- KubeRay ---------------------------------------------------------------------------------------

def test_kuberay_has_ray_token_auth(kuberay):
    (svc,) = kuberay["RayService"]
    assert svc["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}


def test_kuberay_publishes_no_ray_port_outside_the_cluster(kuberay):
    (svc,) = kuberay["RayService"]
    head = svc["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"
    # the dashboard's 0.0.0.0 inside the head pod is the pod's own network namespace, never a
    # node's: no pod shares its node's network
    for pod in _pods(svc):
        assert not pod["spec"].get("hostNetwork") and not pod["spec"].get("hostPort")
        for c in pod["spec"]["containers"]:
            assert all("hostPort" not in p for p in c.get("ports", []))
    for service in kuberay.get("Service", []):  # the render's own Services: Redis only
        assert service["spec"]["type"] == "ClusterIP"
    ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert CLIENT_PORT not in ports  # Ray client: unused, not declared


def test_kuberay_network_policy_admits_only_ingress_scrape_and_operator(kuberay):
    (svc,) = kuberay["RayService"]
    (policy,) = [p for p in kuberay["NetworkPolicy"] if p["metadata"]["name"].endswith("-ray")]
    name = svc["metadata"]["name"]
    assert policy["spec"]["podSelector"]["matchLabels"] == pod_labels(name)
    for pod in _pods(svc):  # the policy selects every Ray pod
        assert pod_labels(name).items() <= pod["metadata"]["labels"].items()
    rules = policy["spec"]["ingress"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    # from anywhere: the HTTP ingress port, nothing else
    open_rules = [r for r in rules if "from" not in r]
    assert open_rules == [{"ports": [{"protocol": "TCP", "port": ASCEND.router.port}]}]
    by_port: dict[int, list] = {}
    for rule in rules:
        for port in rule.get("ports", []):
            by_port.setdefault(port["port"], []).append(rule.get("from"))
    assert by_port[METRICS_PORT] == [[{"namespaceSelector": {}, "podSelector": {
        "matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]]
    operator = [[{"namespaceSelector": {}, "podSelector": {
        "matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}]]
    assert by_port[DASHBOARD_PORT] == by_port[DASHBOARD_AGENT_PORT] == operator
    for inside_only in (HEAD_PORT, CLIENT_PORT, 8404, 9101):  # GCS, client, HAProxy stats
        assert inside_only not in by_port
    # everything else only from the cluster's own pods
    (own,) = [r for r in rules if "ports" not in r]
    assert own == {"from": [{"podSelector": {"matchLabels": pod_labels(name)}}]}


def test_kuberay_keys_come_from_a_secret_mounted_on_every_pod(kuberay):
    (svc,) = kuberay["RayService"]
    assert _serve_router(svc)["api_keys_file"] == KEYS_FILE_IN_POD
    assert _serve_router(svc)["host"] == "0.0.0.0"
    for pod in _pods(svc):
        spec = pod["spec"]
        (vol,) = [v for v in spec["volumes"] if v["name"] == "api-keys"]
        assert vol["secret"]["secretName"] == "embedfleet-api-keys"
        assert vol["secret"]["defaultMode"] == 0o440
        (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "api-keys"]
        assert mount == {"name": "api-keys", "mountPath": KEYS_MOUNT_DIR, "readOnly": True}
        assert KEYS_FILE_IN_POD.startswith(mount["mountPath"] + "/")


def test_kuberay_open_on_purpose_mounts_no_keys():
    cfg = _ascend(router={"host": "0.0.0.0", "allow_unauthenticated": True})
    (svc,) = _kuberay(cfg)["RayService"]
    assert "api_keys_file" not in _serve_router(svc)
    assert _serve_router(svc)["allow_unauthenticated"] is True
    for pod in _pods(svc):
        assert all(v["name"] != "api-keys" for v in pod["spec"]["volumes"])


def test_kuberay_pods_are_confined(kuberay):
    (svc,) = kuberay["RayService"]
    head, worker = _pods(svc)
    for pod, is_worker in ((head, False), (worker, True)):
        (container,) = pod["spec"]["containers"]
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        (shm,) = [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
    head_sc = head["spec"]["containers"][0]["securityContext"]
    assert head_sc["runAsNonRoot"] is True and head_sc["runAsUser"] != 0
    # workers: root for the Ascend driver's device nodes, with DAC_OVERRIDE alone added back
    assert worker["spec"]["containers"][0]["securityContext"]["capabilities"]["add"] == [
        "DAC_OVERRIDE"]


def test_kuberay_weights_are_mounted_read_only(kuberay):
    (svc,) = kuberay["RayService"]
    _, worker = _pods(svc)
    (mount,) = [m for m in worker["spec"]["containers"][0]["volumeMounts"]
                if m["name"] == "hf-cache"]
    assert mount["readOnly"] is True
    (vol,) = [v for v in worker["spec"]["volumes"] if v["name"] == "hf-cache"]
    assert vol["hostPath"]["type"] == "Directory"  # pre-fetched weights: never created empty


def test_kuberay_weights_are_the_hub_cache_and_hf_home_is_writable(kuberay):
    """Hugging Face's libraries write to HF_HOME (a token, the xet cache, lock files): it must
    not be the read-only weights, which are HF_HUB_CACHE alone."""
    (svc,) = kuberay["RayService"]
    _, worker = _pods(svc)
    (container,) = worker["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    mounts = container["volumeMounts"]
    (weights,) = [m for m in mounts if m["name"] == "hf-cache"]
    assert env["HF_HUB_CACHE"] == weights["mountPath"]
    assert not any(_under(env["HF_HOME"], m["mountPath"]) for m in mounts if m.get("readOnly"))
    (home,) = [m for m in mounts if m["mountPath"] == env["HF_HOME"]]
    (vol,) = [v for v in worker["spec"]["volumes"] if v["name"] == home["name"]]
    assert vol["emptyDir"]["sizeLimit"]


def test_kuberay_gcs_is_fault_tolerant_with_a_password_from_a_secret(kuberay):
    (svc,) = kuberay["RayService"]
    ft = svc["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    (redis_svc,) = kuberay["Service"]
    assert ft["redisAddress"] == f"{redis_svc['metadata']['name']}:6379"
    secret = {"secretKeyRef": {"name": "embedfleet-redis", "key": "password"}}
    assert ft["redisPassword"] == {"valueFrom": secret}
    (redis,) = kuberay["Deployment"]
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert container["env"] == [{"name": "REDIS_PASSWORD", "valueFrom": secret}]
    assert "--requirepass" in container["command"][-1] and "--appendonly yes" in \
        container["command"][-1]
    assert container["securityContext"]["runAsNonRoot"] is True
    (claim,) = kuberay["PersistentVolumeClaim"]
    assert redis["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"][
        "claimName"] == claim["metadata"]["name"]
    # only the Ray head reaches Redis
    (policy,) = [p for p in kuberay["NetworkPolicy"] if p["metadata"]["name"].endswith("-redis")]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"][0]["podSelector"]["matchLabels"]["ray.io/node-type"] == "head"


def test_kuberay_with_an_external_redis_renders_none_of_its_own():
    cfg = _ascend(cluster={"image": "registry.local/emb:1", "redis_address": "redis.db:6380"})
    docs = kuberay_manifests(cfg, cluster_spec(cfg))
    assert [d["kind"] for d in docs] == ["NetworkPolicy", "RayService"]
    assert docs[-1]["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"][
        "redisAddress"] == "redis.db:6380"


def test_no_secret_value_is_ever_rendered(kuberay):
    text = render_rayservice(ASCEND, EXAMPLE)
    assert "kind: Secret" not in text
    assert "create secret generic embedfleet-api-keys" in text  # the header says how


@pytest.mark.parametrize("address", ["redis", "redis:port", ":6379", "redis:70000"])
def test_a_bad_redis_address_is_refused_at_load(address):
    with pytest.raises(ConfigError, match="redis_address"):
        _ascend(cluster={"redis_address": address})


# -- the cluster launcher --------------------------------------------------------------------------

def test_launcher_has_ray_token_auth_on_every_node_and_a_loopback_dashboard(launcher):
    head = launcher["head_start_ray_commands"][-1]
    worker = launcher["worker_start_ray_commands"][-1]
    for command in (head, worker.split(" && ")[-1]):
        words = shlex.split(command)
        assert "RAY_AUTH_MODE=token" in words[:words.index("ray")]
    assert "--dashboard-host=127.0.0.1" in shlex.split(head)
    assert launcher["file_mounts"][RAY_TOKEN_FILE] == RAY_TOKEN_FILE
    assert any("RAY_AUTH_MODE=token" in c for c in launcher["setup_commands"])


def test_launcher_syncs_the_keys_file_to_every_node(launcher):
    keys = ASCEND.router.api_keys_file
    assert keys and launcher["file_mounts"][keys] == keys


def test_launcher_weights_are_read_only(launcher):
    assert [o for o in launcher["docker"]["worker_run_options"] if o.startswith("-v /data")] == [
        "-v /data/embedfleet/hf/hub:/models/hf/hub:ro"]


def test_launcher_weights_are_the_hub_cache_and_hf_home_is_writable(launcher):
    options = launcher["docker"]["worker_run_options"]
    env = dict(o.removeprefix("-e ").split("=", 1) for o in options if o.startswith("-e "))
    read_only = [o.split(":")[1] for o in options if o.startswith("-v ") and o.endswith(":ro")]
    assert env["HF_HUB_CACHE"] in read_only
    assert not any(_under(env["HF_HOME"], folder) for folder in read_only)


def test_launcher_refuses_a_loopback_ingress():
    cfg = _ascend(router={"host": "127.0.0.1"})
    with pytest.raises(ConfigError, match="router.host='127.0.0.1' is loopback"):
        render_cluster_launcher(cfg, cluster_spec(cfg, example=True))


def test_launcher_gcs_fault_tolerance_with_an_external_redis():
    cfg = _ascend(cluster={"redis_address": "10.0.0.9:6379"})
    launcher = yaml.safe_load(render_cluster_launcher(cfg, cluster_spec(cfg, example=True)))
    head = launcher["head_start_ray_commands"][-1]
    assert "RAY_REDIS_ADDRESS=10.0.0.9:6379" in head
    assert f'--redis-password="$(cat {REDIS_PASSWORD_FILE})"' in head
    assert launcher["file_mounts"][REDIS_PASSWORD_FILE] == REDIS_PASSWORD_FILE


def test_kuberay_reads_keys_from_the_secret_alone():
    """A config naming a variable too: the pods have none, so the render names only the file."""
    cfg = _ascend(router={"host": "0.0.0.0", "api_keys_env": "MY_KEYS"})
    (svc,) = _kuberay(cfg)["RayService"]
    router = _serve_router(svc)
    assert router["api_keys_file"] == KEYS_FILE_IN_POD and router.get("api_keys_env") is None


def test_launcher_refuses_keys_from_a_variable_its_nodes_do_not_have():
    cfg = _ascend(router={"host": "0.0.0.0", "api_keys_env": "MY_KEYS"})
    with pytest.raises(ConfigError, match="api_keys_env='MY_KEYS' has no value"):
        render_cluster_launcher(cfg, cluster_spec(cfg, example=True))
