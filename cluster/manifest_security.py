"""What closes a rendered 910B cluster: Secrets, pod security, the NetworkPolicy, GCS durability.

The KubeRay render (``manifest_kuberay.py``) and the launcher render (``manifest_launcher.py``)
take their security parts from here, so the rules live in one place and the render tests
(tests/test_manifest_security.py) check them on every rendered manifest:

* Ray's token authentication on every node (``RAY_AUTH_MODE=token``): on KubeRay through its
  ``authOptions`` (KubeRay >= 1.5.1 keeps the token in a Secret it makes and sets it on every
  container, its own operator included); on the launcher from the token file ``ray up`` syncs to
  every node. Anyone who reaches a Ray port without it can submit jobs, i.e. run code on every
  card's node.
* API keys that travel with the deployment: on KubeRay a Secret mounted read-only on every pod
  and named as ``router.api_keys_file`` in the Serve config; on the launcher the config's keys
  file synced to every node. Every ingress replica then finds them, and one that does not fails
  to start (``deployments/ingress/auth.py``).
* KubeRay pods: no privilege escalation, every capability dropped (workers keep DAC_OVERRIDE
  only, see ``WORKER_CAPABILITIES``), the head as a non-root user, the weights' hostPath
  read-only as HF_HUB_CACHE (HF_HOME, which Hugging Face's libraries write to, an emptyDir), a
  bounded ``/dev/shm``, and a NetworkPolicy admitting from outside the cluster's own pods only
  the HTTP ingress, Prometheus' scrape and the KubeRay operator.
* GCS fault tolerance with an external Redis (KubeRay's ``gcsFaultToleranceOptions``), so the
  state kept in Ray's internal KV (the prefix-cache overrides, the governor's last limits:
  ``deployments/fleet/durable.py``) survives a head restart. Without ``cluster.redis_address``
  the render adds a small Redis (one pod, append-only file on a PersistentVolumeClaim).

Secret values are never rendered: the operator creates the Secrets (the manifest header says
how), so a manifest can be committed and reviewed without leaking a key.
"""

from __future__ import annotations

from typing import Any

from .manifest_spec import (DASHBOARD_PORT, HF_HOME_IN_CONTAINER, HF_HUB_CACHE_IN_CONTAINER,
                            METRICS_PORT, AscendClusterSpec)
from ..deployments.config.schema import EmbedfleetConfig

# Where the API keys Secret is mounted on every KubeRay pod (a directory: Kubernetes refreshes a
# Secret volume's files in place, which a subPath mount would not).
KEYS_MOUNT_DIR = "/etc/embedfleet/api-keys"
KEYS_SECRET_KEY = "api-keys"
KEYS_FILE_IN_POD = f"{KEYS_MOUNT_DIR}/{KEYS_SECRET_KEY}"
# HF_HOME holds small files only (a token, lock files; the xet cache stays empty offline).
HF_HOME_SIZE = "1Gi"
REDIS_PASSWORD_KEY = "password"
REDIS_PORT = 6379
# Ray's dashboard agent: KubeRay's RayService controller reads Serve's state through it.
DASHBOARD_AGENT_PORT = 52365
# The Ray image's user (uid 1000); the head needs no device, so it runs as that user.
HEAD_UID = 1000
# Root on workers: the Ascend driver's device nodes (/dev/davinci*, davinci_manager) and files
# are owned by the host's HwHiAiUser, whose uid/gid differ from host to host, so a fixed non-root
# user cannot open them. Root keeps DAC_OVERRIDE only (to open those nodes), nothing else.
WORKER_CAPABILITIES = {"drop": ["ALL"], "add": ["DAC_OVERRIDE"]}


def secret_names(name: str) -> dict[str, str]:
    """The Secrets a cluster named ``name`` reads, by what they hold."""
    return {"api_keys": f"{name}-api-keys", "redis": f"{name}-redis"}


def pod_labels(name: str) -> dict[str, str]:
    """Labels on every Ray pod of the cluster: what the NetworkPolicy selects. Not
    ``app.kubernetes.io/name``, which KubeRay sets on its pods itself."""
    return {"app.kubernetes.io/part-of": "embedfleet", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": "ray"}


def _redis_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "embedfleet", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": "gcs-redis"}


def cluster_router_data(cfg: EmbedfleetConfig) -> dict[str, Any]:
    """The ``router`` section the KubeRay render deploys: the ingress binds the pod's interfaces
    (the Serve Service reaches it there) and reads the keys Secret, unless the config serves an
    open API on purpose (``router.allow_unauthenticated`` with no keys named)."""
    router = cfg.router.model_dump(exclude_unset=False)
    open_on_purpose = cfg.router.allow_unauthenticated and not (
        cfg.router.api_keys_file or cfg.router.api_keys_env)
    router["host"] = "0.0.0.0"
    if not open_on_purpose:
        # the Secret is the one source on the pods: a variable the pods do not have would stop
        # every ingress replica
        router.update(api_keys_file=KEYS_FILE_IN_POD, api_keys_env=None)
    return router


def keys_mounted(cfg: EmbedfleetConfig) -> bool:
    return not (cfg.router.allow_unauthenticated
                and not (cfg.router.api_keys_file or cfg.router.api_keys_env))


def keys_volume(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(volume, mount) of the API keys Secret: read-only, readable by owner and group only."""
    return ({"name": "api-keys", "secret": {"secretName": secret_names(name)["api_keys"],
                                            "defaultMode": 0o440}},
            {"name": "api-keys", "mountPath": KEYS_MOUNT_DIR, "readOnly": True})


def hf_volumes(host_path: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(volume, mount) pairs of a worker's Hugging Face folders: the weights' hostPath read-only
    as HF_HUB_CACHE (``type: Directory``: a pre-fetched cache, never created empty), so a
    compromised replica cannot plant weights the next replica loads; and HF_HOME, where Hugging
    Face's libraries write (a token, the xet cache, lock files), a bounded emptyDir."""
    return [({"name": "hf-cache", "hostPath": {"path": host_path, "type": "Directory"}},
             {"name": "hf-cache", "mountPath": HF_HUB_CACHE_IN_CONTAINER, "readOnly": True}),
            ({"name": "hf-home", "emptyDir": {"sizeLimit": HF_HOME_SIZE}},
             {"name": "hf-home", "mountPath": HF_HOME_IN_CONTAINER})]


def shm_volume(size: str) -> dict[str, Any]:
    # Ray's object store lives in /dev/shm; a pod's default 64 MB would push it to disk, and an
    # unbounded memory-backed emptyDir could take the node's memory.
    return {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size}}


def container_security(worker: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"allowPrivilegeEscalation": False, "privileged": False,
                           "capabilities": (dict(WORKER_CAPABILITIES) if worker
                                            else {"drop": ["ALL"]})}
    if not worker:
        out.update(runAsNonRoot=True, runAsUser=HEAD_UID, runAsGroup=HEAD_UID)
    return out


def pod_security(worker: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"seccompProfile": {"type": "RuntimeDefault"}}
    if not worker:
        out["fsGroup"] = HEAD_UID  # the mounted Secret's files are group-readable
    return out


def gcs_fault_tolerance(name: str, spec: AscendClusterSpec) -> dict[str, Any]:
    """KubeRay's ``gcsFaultToleranceOptions``: the GCS keeps its tables in Redis, so a new head
    pod finds the cluster's state (Serve's, and embedfleet's durable KV) where the old one left
    it. The password comes from a Secret."""
    return {"redisAddress": spec.redis_address or f"{name}-redis:{REDIS_PORT}",
            "redisPassword": {"valueFrom": {"secretKeyRef": {
                "name": secret_names(name)["redis"], "key": REDIS_PASSWORD_KEY}}}}


def redis_manifests(name: str, spec: AscendClusterSpec,
                    namespace: dict[str, str]) -> list[dict[str, Any]]:
    """The in-cluster Redis the GCS writes to, when ``cluster.redis_address`` names none: one
    pod, password from the Secret, append-only file on a claim (a Redis restart keeps the
    tables), a ClusterIP Service, and a NetworkPolicy admitting only the cluster's head."""
    if spec.redis_address:
        return []
    labels = _redis_labels(name)
    meta = {"name": f"{name}-redis", **namespace, "labels": dict(labels)}
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {**meta, "name": f"{name}-redis-data"},
             "spec": {"accessModes": ["ReadWriteOnce"],
                      "resources": {"requests": {"storage": spec.redis_storage}}}}
    password = {"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {
        "name": secret_names(name)["redis"], "key": REDIS_PASSWORD_KEY}}}
    container = {
        "name": "redis", "image": spec.redis_image,
        # The password on the command line comes from the environment, expanded by the shell,
        # so it is in neither the manifest nor the pod spec.
        "command": ["sh", "-c", 'exec redis-server --appendonly yes --dir /data '
                    '--protected-mode yes --requirepass "$REDIS_PASSWORD"'],
        "env": [password],
        "ports": [{"containerPort": REDIS_PORT, "name": "redis"}],
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"},
                      "limits": {"cpu": "1", "memory": "1Gi"}},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        "securityContext": {"allowPrivilegeEscalation": False, "privileged": False,
                            "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
                            "runAsUser": 999, "runAsGroup": 999,
                            "readOnlyRootFilesystem": True},
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                 "selector": {"matchLabels": dict(labels)},
                 "template": {"metadata": {"labels": dict(labels)}, "spec": {
                     "securityContext": {"fsGroup": 999,
                                         "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": [container],
                     "volumes": [{"name": "data", "persistentVolumeClaim": {
                         "claimName": f"{name}-redis-data"}}]}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": meta,
               "spec": {"type": "ClusterIP", "selector": dict(labels),
                        "ports": [{"name": "redis", "port": REDIS_PORT,
                                   "targetPort": REDIS_PORT}]}}
    policy = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
              "metadata": meta,
              "spec": {"podSelector": {"matchLabels": dict(labels)}, "policyTypes": ["Ingress"],
                       "ingress": [{"from": [{"podSelector": {"matchLabels": {
                           **pod_labels(name), "ray.io/node-type": "head"}}}],
                           "ports": [{"protocol": "TCP", "port": REDIS_PORT}]}]}}
    return [claim, deployment, service, policy]


def ray_network_policy(cfg: EmbedfleetConfig, name: str, spec: AscendClusterSpec,
                       namespace: dict[str, str]) -> dict[str, Any]:
    """Ingress to the Ray pods: anything from the cluster's own pods (Ray's ports between
    nodes), and from elsewhere only the HTTP ingress (any source), the metrics port (Prometheus'
    pods) and the dashboard with its agent (the KubeRay operator's pods). GCS (6379), Ray client
    (10001), HAProxy's stats (8404) and metrics (9101) ports and every worker port stay inside."""
    def pods(selector: dict[str, str]) -> dict[str, Any]:
        return {"namespaceSelector": {}, "podSelector": {"matchLabels": dict(selector)}}

    def tcp(*ports: int) -> list[dict[str, Any]]:
        return [{"protocol": "TCP", "port": p} for p in ports]

    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": f"{name}-ray", **namespace, "labels": dict(spec.labels)},
        "spec": {
            "podSelector": {"matchLabels": pod_labels(name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": pod_labels(name)}}]},
                {"ports": tcp(cfg.router.port)},
                {"from": [pods(spec.prometheus_selector)], "ports": tcp(METRICS_PORT)},
                {"from": [pods(spec.operator_selector)],
                 "ports": tcp(DASHBOARD_PORT, DASHBOARD_AGENT_PORT)},
            ],
        },
    }


def secret_commands(cfg: EmbedfleetConfig, name: str, spec: AscendClusterSpec) -> list[str]:
    """How the operator creates the Secrets the manifest reads (for its header)."""
    ns = f" -n {spec.namespace}" if spec.namespace else ""
    out = []
    if keys_mounted(cfg):
        out.append(f"kubectl create secret generic {secret_names(name)['api_keys']}{ns} "
                   f"--from-file={KEYS_SECRET_KEY}=<keys file> (one key per line, "
                   "docs/security.md)")
    out.append(f"kubectl create secret generic {secret_names(name)['redis']}{ns} "
               f"--from-literal={REDIS_PASSWORD_KEY}=\"$(openssl rand -hex 24)\"")
    return out


# -- the cluster launcher (`ray up`) -----------------------------------------------------------

# Ray's default token file, on the machine running `ray up` and (synced) on every node.
RAY_TOKEN_FILE = "~/.ray/auth_token"
RAY_TOKEN_ENV = {"RAY_AUTH_MODE": "token"}
AUTH_EXPORT = "export RAY_AUTH_MODE=token"
# The Redis password file on the machine running `ray up` and (synced) on the head.
REDIS_PASSWORD_FILE = "~/.embedfleet/redis-password"


def launcher_secret_mounts(cfg: EmbedfleetConfig, spec: AscendClusterSpec) -> dict[str, str]:
    """file_mounts (node path -> path where `ray up` runs) of the cluster's secrets: Ray's
    token (make it first: `ray get-auth-token --generate`), the config's API keys file at the
    same path (every ingress replica reads it there), and the Redis password when the GCS
    writes to one."""
    out = {RAY_TOKEN_FILE: RAY_TOKEN_FILE}
    if cfg.router.api_keys_file:
        out[cfg.router.api_keys_file] = cfg.router.api_keys_file
    if spec.redis_address:
        out[REDIS_PASSWORD_FILE] = REDIS_PASSWORD_FILE
    return out


def launcher_redis_env(spec: AscendClusterSpec) -> dict[str, str]:
    """The head's GCS fault tolerance on the launcher: Ray reads the Redis address from here."""
    return {"RAY_REDIS_ADDRESS": spec.redis_address} if spec.redis_address else {}


def launcher_redis_flag(spec: AscendClusterSpec) -> str:
    if not spec.redis_address:
        return ""
    return f'--redis-password="$(cat {REDIS_PASSWORD_FILE})" '
