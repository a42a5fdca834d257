"""Cluster manifests for Ascend 910B nodes, rendered from the one embedfleet config.

Two ways to run the same Serve application on 910B nodes (8 cards each):

* ``render_cluster_launcher``: a Ray cluster-launcher YAML (``ray up``) for on-premises nodes
  reached over SSH, each running the embedfleet image in Docker. 910B servers are bought, not
  rented from a cloud Ray has a node provider for, so this is Ray's ``local`` provider.
* ``render_rayservice``: a KubeRay ``RayService`` whose ``serveConfigV2`` is the rendered Serve
  config (``embedfleet.cluster.render.serve_config``), for Kubernetes with the Ascend device plugin.

In both, the head node advertises no cards (``NPU: 0``) so no engine replica lands on it, and each
worker advertises its cards as Ray's ``NPU`` resource, the one the engine replicas ask for
(``embedfleet.deployments.options.card_actor_options``). How many worker nodes follows from the config: the
sum of the models' replica bounds divided by the cards per node.

Where the cluster runs (image, node addresses, node selectors, cards per node) comes from the
config's ``cluster`` section (``embedfleet.deployments.config.ClusterDeployConfig``), overridden by the
``embedfleet render`` flags; ``cluster_spec`` merges them into an ``AscendClusterSpec``, which also
holds the facts with sound defaults (pod sizes, device-plugin resource, cache folder). Nothing that
must be real is guessed: without an image (and, for the launcher, head and worker addresses) the
render is refused, naming the flag and the config field. ``example=True`` (``render --example``)
fills the gaps with documentation placeholders (``registry.example.com``, TEST-NET-1 addresses)
and says so in the header; the checked-in examples under ``cluster/examples/`` are rendered that
way (``python -m embedfleet.cluster.manifests``).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from embedfleet.cluster.render import render_yaml, serve_config
# The CANN release the pinned vllm-ascend requires, which the image must carry.
from embedfleet.deployments.engine.ascend_release import CANN_VERSION, RAY, VLLM_ASCEND_VERSION
from embedfleet.deployments.engine.platform import ASCEND_ENGINE_ENV
from embedfleet.deployments.config import ClusterDeployConfig, ConfigError, EmbedfleetConfig, load_config

# The Ascend stack's ray[serve] pin (the `ascend` extra): head, workers and the image must all
# run it. Not the CPU stack's 2.60.0, which cannot resolve beside vllm-ascend's fastapi bound.
RAY_VERSION = RAY
HEAD_PORT = 6379
DASHBOARD_PORT = 8265
CLIENT_PORT = 10001
# KubeRay's default metrics port, used in the launcher too so one scrape config fits both.
METRICS_PORT = 8080
HF_HOME_IN_CONTAINER = "/models/hf"

# Process environment of the Ascend stack on every node (replicas inherit it from `ray start`):
# the engine settings replicas also set for themselves (embedfleet.deployments.engine.platform.ASCEND_ENGINE_ENV:
# expandable segments, deterministic kernels for the canary), plus where the weights are.
# No HCCL_IF_IP / HCCL_SOCKET_IFNAME: a replica holds one card (no tensor parallelism).
ASCEND_ENV = {
    **ASCEND_ENGINE_ENV,
    # Weights are read from this cache only (the Serve runtime env sets HF_HUB_OFFLINE=1).
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
    """Image with CANN (``CANN_VERSION``), torch-npu, vllm-ascend and Ray, on every node."""
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
    hf_cache_host_path: str = "/data/embedfleet/hf"
    """Host folder holding the pre-fetched Hugging Face cache, mounted at ``/models/hf``."""
    device_plugin_resource: str = "huawei.com/Ascend910"
    """Kubernetes extended resource the Ascend device plugin advertises for 910B cards."""
    head_cpu: str = "8"
    head_memory: str = "32Gi"
    worker_cpu: str = "64"
    """Per worker pod: the engine replicas (1 Ray CPU each), their tokenizers and engine cores."""
    worker_memory: str = "512Gi"
    """Per worker pod: eight replicas each stage ~16 GB of bf16 weights through host memory."""
    worker_group: str = "ascend-910b"
    labels: dict[str, str] = field(default_factory=lambda: {"app.kubernetes.io/name": "embedfleet"})


def _require_ascend(cfg: EmbedfleetConfig) -> None:
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


def _resources_json(cfg: EmbedfleetConfig, cards: int) -> str:
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
        ssh_user=section.ssh_user, ssh_private_key=section.ssh_private_key)
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
_SOURCES = {
    "image": ("--image", "cluster.image", "the image"),
    "head_ip": ("--head-address", "cluster.head_address", "the head address"),
    "worker_ips": ("--worker-address", "cluster.worker_addresses", "the worker addresses"),
}


def _require(spec: AscendClusterSpec, manifest: str, *names: str) -> None:
    if missing := [n for n in names if not getattr(spec, n)]:
        what = " and ".join(_SOURCES[n][2] for n in missing)
        how = ", ".join(f"{_SOURCES[n][0]} (or {_SOURCES[n][1]} in the config)" for n in missing)
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


# -- Ray cluster launcher ---------------------------------------------------------------------

def cluster_launcher_config(cfg: EmbedfleetConfig,
                            spec: AscendClusterSpec | None = None) -> dict[str, Any]:
    """The cluster-launcher config as data (see ``render_cluster_launcher``)."""
    _require_ascend(cfg)
    spec = spec or cluster_spec(cfg)
    _require(spec, "--ray-cluster", "image", "head_ip", "worker_ips")
    cards = cards_per_node(cfg, spec)
    workers = list(spec.worker_ips)
    need = sum(m.replicas.min_replicas for m in cfg.models)
    if len(workers) * cards < need:
        raise ConfigError(
            f"{len(workers)} worker address(es) x {cards} cards = {len(workers) * cards} cards, "
            f"fewer than the {need} the models' min_replicas need: add worker addresses "
            "(--worker-address / cluster.worker_addresses)")
    env_opts = [f"-e {k}={v}" for k, v in ASCEND_ENV.items()]
    devices = [f"--device=/dev/davinci{i}" for i in range(cards)]
    devices += [f"--device={d}" for d in ASCEND_MANAGEMENT_DEVICES]
    driver = [f"-v {p}:{p}:ro" for p in ASCEND_DRIVER_MOUNTS]
    source_cann = " && ".join(f"source {s}" for s in spec.cann_set_env)
    return {
        "cluster_name": spec.cluster_name or cfg.app_name,
        # Manually managed on-premises nodes: Ray keeps every listed worker in the cluster. The
        # local provider takes no available_node_types (`ray up` refuses them), so the head/worker
        # split is made by the `ray start --resources` below. Nor has it any node selector: the
        # nodes are exactly these addresses, so the config's node_selector does not apply here.
        "provider": {"type": "local", "head_ip": spec.head_ip, "worker_ips": workers},
        "auth": {"ssh_user": spec.ssh_user, "ssh_private_key": spec.ssh_private_key},
        "max_workers": len(workers),
        "docker": {
            "image": spec.image,
            "container_name": "embedfleet",
            "pull_before_run": True,
            # Only workers get cards and the Ascend stack's settings: the head runs no engine
            # and may be a machine without cards.
            "worker_run_options": env_opts + devices + driver
            + [f"-v {spec.hf_cache_host_path}:{HF_HOME_IN_CONTAINER}"],
        },
        "file_mounts": {"~/embedfleet": spec.repo_dir},
        "rsync_exclude": [".venv", ".git", "**/__pycache__", ".embedfleet", "benchmarks/results"],
        # The image already carries the heavy pins (vllm-ascend, torch-npu); this installs
        # embedfleet itself, so `embedfleet.deployments.app:build_app` imports on every node.
        # vllm-ascend and vLLM are built from source (cluster/install_ascend.sh); `make setup`
        # is idempotent, so with the image's stack already built it only installs embedfleet.
        "setup_commands": ["cd ~/embedfleet && make setup EXTRAS=ascend"],
        "head_start_ray_commands": [
            "ray stop",
            f"ray start --head --port={HEAD_PORT} --dashboard-host=0.0.0.0 "
            f"--metrics-export-port={METRICS_PORT} --resources='{_resources_json(cfg, 0)}' "
            "--autoscaling-config=~/ray_bootstrap_config.yaml",
        ],
        "worker_start_ray_commands": [
            "ray stop",
            # Replicas inherit this shell's environment: CANN's set_env.sh must run here.
            f"{source_cann} && ray start --address=$RAY_HEAD_IP:{HEAD_PORT} "
            f"--metrics-export-port={METRICS_PORT} --resources='{_resources_json(cfg, cards)}'",
        ],
    }


# -- KubeRay RayService -----------------------------------------------------------------------

def _ray_start_resources(cfg: EmbedfleetConfig, cards: int) -> str:
    """KubeRay's quoting of the `resources` rayStartParam: '"{\\"NPU\\": 8}"' in the YAML."""
    return '"' + _resources_json(cfg, cards).replace('"', '\\"') + '"'


def _env() -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in ASCEND_ENV.items()]


def _sizes(cpu: str, memory: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    want = {"cpu": cpu, "memory": memory, **(extra or {})}
    return {"limits": dict(want), "requests": dict(want)}


# Ray's object store lives in /dev/shm; a pod's default 64 MB would push it to disk.
_SHM_VOLUME = {"name": "dshm", "emptyDir": {"medium": "Memory"}}
_SHM_MOUNT = {"name": "dshm", "mountPath": "/dev/shm"}


def rayservice_manifest(cfg: EmbedfleetConfig,
                        spec: AscendClusterSpec | None = None) -> dict[str, Any]:
    """The RayService as data (see ``render_rayservice``)."""
    _require_ascend(cfg)
    spec = spec or cluster_spec(cfg)
    _require(spec, "--kuberay", "image")
    name = spec.cluster_name or cfg.app_name
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 47:
        raise ConfigError(f"RayService name {name!r} (app_name) is not a DNS-1035 label of at most "
                          "47 characters, as KubeRay requires: set cluster.name in the config")
    cards = cards_per_node(cfg, spec)
    min_workers, max_workers = worker_bounds(cfg, spec)
    worker_selector = dict(spec.node_selector)
    head_selector = worker_selector if spec.head_node_selector is None \
        else dict(spec.head_node_selector)
    head = {
        "rayStartParams": {
            "dashboard-host": "0.0.0.0",
            "resources": _ray_start_resources(cfg, 0),  # no engine replica on the head
        },
        "template": {"spec": {
            "containers": [{
                "name": "ray-head",
                "image": spec.image,
                "resources": _sizes(spec.head_cpu, spec.head_memory),
                "ports": [
                    {"containerPort": HEAD_PORT, "name": "gcs-server"},
                    {"containerPort": DASHBOARD_PORT, "name": "dashboard"},
                    {"containerPort": CLIENT_PORT, "name": "client"},
                    {"containerPort": cfg.router.port, "name": "serve"},
                    {"containerPort": METRICS_PORT, "name": "metrics"},
                ],
                "volumeMounts": [dict(_SHM_MOUNT)],
            }],
            "volumes": [dict(_SHM_VOLUME)],
            **({"nodeSelector": head_selector} if head_selector else {}),
        }},
    }
    worker = {
        "groupName": spec.worker_group,
        "replicas": min_workers,
        "minReplicas": min_workers,
        "maxReplicas": max_workers,
        # The device plugin hands the pod its cards (with Ascend Docker Runtime mounting the
        # driver). Ray would count /dev/davinci* itself, but the autoscaler only learns a
        # group's NPUs from this parameter. CANN's environment (set_env.sh) must be in the
        # image's ENV: KubeRay starts Ray through a login shell that may not source it, and
        # the replicas' start-up check refuses to run without it.
        "rayStartParams": {"resources": _ray_start_resources(cfg, cards)},
        "template": {"spec": {
            "containers": [{
                "name": "ray-worker",
                "image": spec.image,
                "resources": _sizes(spec.worker_cpu, spec.worker_memory,
                                    {spec.device_plugin_resource: cards}),
                "env": _env(),
                "ports": [{"containerPort": METRICS_PORT, "name": "metrics"}],
                "volumeMounts": [dict(_SHM_MOUNT),
                                 {"name": "hf-cache", "mountPath": HF_HOME_IN_CONTAINER}],
            }],
            "volumes": [dict(_SHM_VOLUME),
                        {"name": "hf-cache", "hostPath": {"path": spec.hf_cache_host_path,
                                                          "type": "DirectoryOrCreate"}}],
            **({"nodeSelector": worker_selector} if worker_selector else {}),
        }},
    }
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name, **({"namespace": spec.namespace} if spec.namespace else {}),
                     "labels": dict(spec.labels)},
        "spec": {
            "serveConfigV2": serve_config_v2(cfg),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                # Worker pods only need to come and go when the replica bounds span nodes.
                "enableInTreeAutoscaling": min_workers < max_workers,
                "headGroupSpec": head,
                "workerGroupSpecs": [worker],
            },
        },
    }


def serve_config_v2(cfg: EmbedfleetConfig) -> str:
    """The Serve config KubeRay deploys: ``serve_config(cfg)`` as YAML text."""
    return yaml.safe_dump(serve_config(cfg), sort_keys=False)


# -- YAML text --------------------------------------------------------------------------------

class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings (the embedded Serve config), no YAML aliases; with a
    wide line limit so shell commands stay on one line, as an operator would grep for them."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _dump(header: str, data: dict[str, Any]) -> str:
    return header + yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=1 << 16)


def _header(spec: AscendClusterSpec, uses: tuple[str, ...], *paragraphs: str) -> str:
    """The comment block on top of a manifest; ``uses``: the spec values this manifest carries
    (the placeholders among them are called out)."""
    out = ["Generated by cluster/manifests.py from the embedfleet config; do not edit."]
    if placeholders := [n for n in spec.placeholders if n in uses]:
        flags = ", ".join(_SOURCES[n][0] for n in placeholders)
        fields = ", ".join(_SOURCES[n][1] for n in placeholders)
        shown = {"image": f"image {EXAMPLE_IMAGE}", "head_ip": f"head_ip {EXAMPLE_HEAD_IP}",
                 "worker_ips": "worker_ips 192.0.2.x"}
        out.append("EXAMPLE (rendered with --example), not to apply as is. Documentation "
                   "placeholders (a reserved domain, TEST-NET-1 addresses) that reach no real "
                   f"node: {', '.join(shown[n] for n in placeholders)}. Render again with "
                   f"{flags} (or {fields} in the config).")
    out.append(f"The image must carry CANN {CANN_VERSION} (what vllm-ascend {VLLM_ASCEND_VERSION} "
               f"requires), torch-npu, vllm-ascend and ray[serve] {RAY_VERSION}, with CANN's "
               "set_env.sh variables in its ENV.")
    out += paragraphs
    return "".join(f"# {line}\n" for par in out for line in textwrap.wrap(par, 96, break_on_hyphens=False))


def render_cluster_launcher(cfg: EmbedfleetConfig, spec: AscendClusterSpec | None = None) -> str:
    """Ray cluster-launcher YAML for 910B nodes: head without cards, workers with NPU: N."""
    spec = spec or cluster_spec(cfg)
    data = cluster_launcher_config(cfg, spec)
    notes = []
    if spec.node_selector or spec.head_node_selector:
        # The launcher has no selector concept: say so rather than drop the config's silently.
        notes.append("cluster.node_selector is not applied: Ray's cluster launcher (local "
                     "provider) has no node selector; its nodes are exactly provider.head_ip and "
                     "provider.worker_ips.")
    notes.append("From the repository root: ray up <this file>; then deploy the Serve config.")
    return _dump(_header(spec, ("image", "head_ip", "worker_ips"), *notes), data)


def render_rayservice(cfg: EmbedfleetConfig, spec: AscendClusterSpec | None = None) -> str:
    """KubeRay RayService YAML: serveConfigV2 from the config, device-plugin cards as NPU."""
    spec = spec or cluster_spec(cfg)
    data = rayservice_manifest(cfg, spec)
    apply = "kubectl apply -f <this file>" if spec.namespace else \
        "kubectl apply -n <namespace> -f <this file>"
    return _dump(_header(spec, ("image",), f"Then: {apply}"), data)


# -- the checked-in examples ------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES_DIR = Path(__file__).resolve().parent / "examples"
ASCEND_910B_CONFIG = REPO_ROOT / "deployments" / "configs" / "ascend-910b-qwen3-embedding-8b.yaml"
LOCAL_CPU_CONFIG = REPO_ROOT / "deployments" / "configs" / "local-cpu.yaml"


def example_files() -> dict[str, str]:
    """File name under ``cluster/examples/`` -> its rendered text (the golden tests' truth)."""
    ascend = load_config(ASCEND_910B_CONFIG)
    example = cluster_spec(ascend, example=True)  # what `embedfleet render --example` prints
    return {
        "ray-cluster-910b.yaml": render_cluster_launcher(ascend, example),
        "rayservice-910b.yaml": render_rayservice(ascend, example),
        "serve-910b.yaml": render_yaml(ascend),
        "serve-local-cpu.yaml": render_yaml(load_config(LOCAL_CPU_CONFIG)),
    }


def write_examples(out_dir: Path = EXAMPLES_DIR) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in example_files().items():
        path = out_dir / name
        path.write_text(text)
        written.append(path)
    return written


if __name__ == "__main__":  # python -m embedfleet.cluster.manifests: regenerate the examples
    for p in write_examples():
        print(p.relative_to(REPO_ROOT), file=sys.stdout)
