"""What every 910B cluster manifest shares: the spec of where and on what the cluster runs.

``cluster_spec`` merges the config's ``cluster`` section
(``embedfleet.deployments.config.cluster.ClusterDeployConfig``) with the ``embedfleet render``
flags into an ``AscendClusterSpec``, which also holds the facts with sound defaults (pod sizes,
device-plugin resource, cache folder); ``image_flag``, ``address_flag`` and ``node_selector_flag``
check each flag by the same section's rules. Also here: the node facts both manifests use (Ray
ports, the Ascend environment, devices and driver mounts), the worker count that follows from the
models' replica bounds, and the documentation placeholders of ``render --example``.
The manifests themselves: ``manifest_launcher.py`` (Ray cluster launcher), ``manifest_kuberay.py``
(KubeRay RayService), rendered as YAML text by ``manifests.py``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from ..deployments.config.schema import ConfigError, EmbedfleetConfig
from ..deployments.config.cluster import ClusterDeployConfig
from ..deployments.engine.ascend_release import RAY
from ..deployments.engine.platform import ASCEND_ENGINE_ENV

# The Ascend stack's ray[serve,data] pin (the `ascend` extra): head, workers and the image must all
# run it. Not the CPU stack's 2.60.0, which cannot resolve beside vllm-ascend's fastapi bound.
RAY_VERSION = RAY
HEAD_PORT = 6379
DASHBOARD_PORT = 8265
CLIENT_PORT = 10001
# KubeRay's default metrics port, used in the launcher too so one scrape config fits both.
METRICS_PORT = 8080
# The weights: the pre-fetched Hugging Face hub cache, mounted read-only as HF_HUB_CACHE. HF_HOME,
# where Hugging Face's libraries write (a token, the xet cache, lock files), is a writable folder
# apart from it: an emptyDir on KubeRay, the container's own filesystem in the launcher's.
HF_HUB_CACHE_IN_CONTAINER = "/models/hf/hub"
HF_HOME_IN_CONTAINER = "/var/tmp/hf-home"

# Process environment of the Ascend stack on every node (replicas inherit it from `ray start`):
# the engine settings replicas also set for themselves (embedfleet.deployments.engine.platform.ASCEND_ENGINE_ENV:
# expandable segments, deterministic kernels for the canary), plus where the weights are.
# No HCCL_IF_IP / HCCL_SOCKET_IFNAME: a replica holds one card (no tensor parallelism).
ASCEND_ENV = {
    **ASCEND_ENGINE_ENV,
    # Weights are read from this cache only (the Serve runtime env sets HF_HUB_OFFLINE=1).
    "HF_HUB_CACHE": HF_HUB_CACHE_IN_CONTAINER,
    "HF_HOME": HF_HOME_IN_CONTAINER,
}
# The driver's management device nodes; every card also needs its /dev/davinciN.
ASCEND_MANAGEMENT_DEVICES = ("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc")
# Host driver files a container needs beside the device nodes (what Ascend Docker Runtime mounts
# on Kubernetes; plain Docker needs them spelled out).
ASCEND_DRIVER_MOUNTS = (
    "/usr/local/dcmi",
    "/usr/local/bin/npu-smi",
    "/usr/local/Ascend/driver/lib64",
    "/usr/local/Ascend/driver/version.info",
    "/etc/ascend_install.info",
)


# Documentation placeholders, used only with example=True (`render --example`): a reserved
# domain (RFC 2606) and TEST-NET-1 addresses (RFC 5737), so they can never reach a real node.
EXAMPLE_IMAGE = "registry.example.com/embedfleet/embedfleet-ascend:0.1.0"
EXAMPLE_HEAD_IP = "192.0.2.10"


def _example_worker_ips(count: int) -> tuple[str, ...]:
    return tuple(f"192.0.2.{11 + i}" for i in range(count))


@dataclass(frozen=True)
class AscendClusterSpec:
    """Where and on what the cluster runs: what the embedfleet config leaves to the operator.

    ``image``, ``head_ip`` and ``worker_ips`` have no defaults: a render that needs one and lacks
    it is refused (``ConfigError``). Build a spec with ``cluster_spec`` (config + flags)."""

    image: str | None = None
    """Image with CANN (``ascend_release.CANN_VERSION``), torch-npu, vllm-ascend and Ray, on every node."""
    cluster_name: str | None = None
    """Ray cluster / RayService name; None = the config's app_name."""
    namespace: str | None = None
    """KubeRay only: the RayService's namespace; None = kubectl's."""
    cards_per_node: int | None = None
    """NPUs each worker advertises; None = the config's ``cards``."""
    head_ip: str | None = None
    """Launcher only: the head node's address (provider.head_ip)."""
    worker_ips: tuple[str, ...] = ()
    """Launcher only: the worker nodes' addresses (provider.worker_ips)."""
    node_selector: Mapping[str, str] = field(default_factory=dict)
    """KubeRay only: node labels of the worker pods (the launcher has no selector concept)."""
    head_node_selector: Mapping[str, str] | None = None
    """KubeRay only: node labels of the head pod; None = ``node_selector``."""
    placeholders: tuple[str, ...] = ()
    """Fields filled with documentation placeholders (``example=True``); the header names them."""
    ssh_user: str = "root"
    ssh_private_key: str = "~/.ssh/id_rsa"
    repo_dir: str = "."
    """Launcher only: the embedfleet checkout `ray up` runs from, synced to every node."""
    cann_set_env: tuple[str, ...] = (
        "/usr/local/Ascend/ascend-toolkit/set_env.sh",
        "/usr/local/Ascend/nnal/atb/set_env.sh",
    )
    """Launcher only: sourced before `ray start` on workers so replicas inherit CANN's env."""
    hf_cache_host_path: str = "/data/embedfleet/hf/hub"
    """Host folder holding the pre-fetched Hugging Face hub cache (``models--org--name/``, what
    ``HF_HUB_CACHE=<it> hf download <model>`` fills; the ``hub`` folder of an ``HF_HOME``),
    mounted read-only at ``HF_HUB_CACHE_IN_CONTAINER``."""
    device_plugin_resource: str = "huawei.com/Ascend910"
    """Kubernetes extended resource the Ascend device plugin advertises for 910B cards."""
    head_cpu: str = "8"
    head_memory: str = "32Gi"
    worker_cpu: str = "64"
    """Per worker pod: the engine replicas (1 Ray CPU each), their tokenizers and engine cores."""
    worker_memory: str = "512Gi"
    """Per worker pod: eight replicas each stage ~16 GB of bf16 weights through host memory."""
    worker_group: str = "ascend-910b"
    head_shm: str = "8Gi"
    """KubeRay: the head's /dev/shm bound (Ray's object store there; the head holds no engine)."""
    worker_shm: str = "64Gi"
    """KubeRay: a worker's /dev/shm bound: Ray's object store, through which large calls'
    texts and vectors pass, within the pod's memory."""
    redis_address: str | None = None
    """KubeRay: host:port of the Redis the GCS keeps its tables in; None = the render's own."""
    redis_image: str = "redis:7.4-alpine"
    redis_storage: str = "1Gi"
    prometheus_selector: Mapping[str, str] = field(
        default_factory=lambda: {"app.kubernetes.io/name": "prometheus"})
    """KubeRay: labels of the Prometheus pods the NetworkPolicy lets scrape the metrics port."""
    operator_selector: Mapping[str, str] = field(
        default_factory=lambda: {"app.kubernetes.io/name": "kuberay-operator"})
    """KubeRay: labels of the KubeRay operator's pods, which reach the dashboard."""
    labels: dict[str, str] = field(default_factory=lambda: {"app.kubernetes.io/name": "embedfleet"})


def require_ascend(cfg: EmbedfleetConfig) -> None:
    if cfg.platform.kind != "ascend":
        raise ValueError(f"cluster manifests are for Ascend nodes; this config has "
                         f"platform.kind={cfg.platform.kind!r}")


def cards_per_node(cfg: EmbedfleetConfig, spec: AscendClusterSpec) -> int:
    return spec.cards_per_node or cfg.cards


def worker_bounds(cfg: EmbedfleetConfig, spec: AscendClusterSpec) -> tuple[int, int]:
    """(min, max) worker nodes: enough cards for every model's min / max replicas."""
    per = cards_per_node(cfg, spec)
    low = sum(m.replicas.min_replicas for m in cfg.models)
    high = sum(m.replicas.max_replicas for m in cfg.models)
    return math.ceil(low / per), max(1, math.ceil(high / per))


def resources_json(cfg: EmbedfleetConfig, cards: int) -> str:
    """Ray resources of a node as JSON: the card resource the engine replicas ask for."""
    return json.dumps({cfg.platform.card_resource: cards})


# -- the spec: config section + render flags --------------------------------------------------

def cluster_spec(cfg: EmbedfleetConfig, *, image: str | None = None,
                 head_address: str | None = None, worker_addresses: Iterable[str] = (),
                 node_selector: Mapping[str, str] | None = None,
                 example: bool = False) -> AscendClusterSpec:
    """The spec from the config's ``cluster`` section, with the render flags on top.

    A flag given replaces the config's value; ``worker_addresses`` replace the config's whole
    list; ``node_selector`` entries are merged over the config's, key by key. The merge is checked
    by the config section's own rules (e.g. the head listed among the workers). ``example=True``
    fills what neither gives with documentation placeholders (``with_example_placeholders``)."""
    data = cfg.cluster.model_dump() if cfg.cluster else {}
    if image is not None:
        data["image"] = image
    if head_address is not None:
        data["head_address"] = head_address
    if workers := list(worker_addresses):
        data["worker_addresses"] = workers
    if node_selector:
        data["node_selector"] = {**data.get("node_selector", {}), **node_selector}
    try:
        section = ClusterDeployConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError("the config's cluster section with the render flags: "
                          + _reasons(err)) from None
    spec = AscendClusterSpec(
        image=section.image, cluster_name=section.name, namespace=section.namespace,
        cards_per_node=section.cards_per_node, head_ip=section.head_address,
        worker_ips=tuple(section.worker_addresses), node_selector=dict(section.node_selector),
        head_node_selector=(None if section.head_node_selector is None
                            else dict(section.head_node_selector)),
        ssh_user=section.ssh_user, ssh_private_key=section.ssh_private_key,
        redis_address=section.redis_address)
    return with_example_placeholders(cfg, spec) if example else spec


def with_example_placeholders(cfg: EmbedfleetConfig, spec: AscendClusterSpec) -> AscendClusterSpec:
    """``spec`` with documentation placeholders where it has no image, head or workers."""
    filled: dict[str, Any] = {}
    if spec.image is None:
        filled["image"] = EXAMPLE_IMAGE
    if spec.head_ip is None:
        filled["head_ip"] = EXAMPLE_HEAD_IP
    if not spec.worker_ips:
        filled["worker_ips"] = _example_worker_ips(worker_bounds(cfg, spec)[1])
    return replace(spec, placeholders=spec.placeholders + tuple(filled), **filled)


# Where each spec value comes from (flag, config field), for the messages that refuse a render
# without it, and what it is called there.
SOURCES = {
    "image": ("--image", "cluster.image", "the image"),
    "head_ip": ("--head-address", "cluster.head_address", "the head address"),
    "worker_ips": ("--worker-address", "cluster.worker_addresses", "the worker addresses"),
}


def require_given(spec: AscendClusterSpec, manifest: str, *names: str) -> None:
    if missing := [n for n in names if not getattr(spec, n)]:
        what = " and ".join(SOURCES[n][2] for n in missing)
        how = ", ".join(f"{SOURCES[n][0]} (or {SOURCES[n][1]} in the config)" for n in missing)
        raise ConfigError(f"{manifest} needs {what}, given neither by flag nor config: pass "
                          f"{how}. `render --example` prints documentation placeholders instead, "
                          "not to apply as is")


def _reasons(err: ValidationError) -> str:
    return "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in err.errors())


def _flag_type(to_data: Callable[[str], tuple[Any, dict[str, Any]]]) -> Callable[[str], Any]:
    """An argparse ``type=`` checking one flag value by the config section's rules: a bad value
    exits 2 with ``argument --flag: <the value and why>``."""
    def check(text: str) -> Any:
        value, data = to_data(text)
        try:
            ClusterDeployConfig.model_validate(data)
        except ValidationError as err:  # the message names the value; the flag names the field
            (name,) = data
            raise argparse.ArgumentTypeError(_reasons(err).removeprefix(f"{name}: ")) from None
        return value
    return check


def _node_selector_pair(text: str) -> tuple[tuple[str, str], dict[str, Any]]:
    key, eq, value = text.partition("=")
    if not eq:
        raise argparse.ArgumentTypeError(f"{text!r} is not key=value")
    return (key, value), {"node_selector": {key: value}}


image_flag = _flag_type(lambda t: (t, {"image": t}))
address_flag = _flag_type(lambda t: (t, {"head_address": t}))
node_selector_flag = _flag_type(_node_selector_pair)
