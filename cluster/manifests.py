"""Cluster manifests for Ascend 910B nodes, rendered from the one embedfleet config.

Two ways to run the same Serve application on 910B nodes (8 cards each):

* ``render_cluster_launcher``: a Ray cluster-launcher YAML (``ray up``) for on-premises nodes
  reached over SSH, each running the embedfleet image in Docker. 910B servers are bought, not
  rented from a cloud Ray has a node provider for, so this is Ray's ``local`` provider.
* ``render_rayservice``: a KubeRay ``RayService`` whose ``serveConfigV2`` is the rendered Serve
  config (``cluster.render.serve_config``), for Kubernetes with the Ascend device plugin.

In both, the head node advertises no cards (``NPU: 0``) so no engine replica lands on it, and each
worker advertises its cards as Ray's ``NPU`` resource, the one the engine replicas ask for
(``deployments.options.card_actor_options``). How many worker nodes follows from the config: the
sum of the models' replica bounds divided by the cards per node.

Facts the embedfleet config does not carry (image, addresses, pod sizes) come from an
``AscendClusterSpec`` whose defaults are placeholders to replace; the checked-in examples under
``cluster/examples/`` are rendered with those defaults (``python -m cluster.manifests``).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cluster.render import render_yaml, serve_config
from deployments.config import EmbedfleetConfig, load_config

# The ray[serve] pin in pyproject.toml: head, workers and the image must all run this version.
RAY_VERSION = "2.60.0"
HEAD_PORT = 6379
DASHBOARD_PORT = 8265
CLIENT_PORT = 10001
# KubeRay's default metrics port, used in the launcher too so one scrape config fits both.
METRICS_PORT = 8080
HF_HOME_IN_CONTAINER = "/models/hf"

# Process environment of the Ascend stack on every node (replicas inherit it from `ray start`).
# No HCCL_* settings: a replica holds one card (no tensor parallelism), so no collective traffic
# crosses cards; HCCL_IF_IP / HCCL_SOCKET_IFNAME matter only if a model is ever split over cards.
ASCEND_ENV = {
    # Pooling batches vary in shape step to step; expandable segments keep the NPU caching
    # allocator from fragmenting, which a 0.95 memory utilisation leaves no slack for.
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
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


@dataclass(frozen=True)
class AscendClusterSpec:
    """Where and on what the cluster runs: what the embedfleet config leaves to the operator."""

    image: str = "registry.example.com/embedfleet/embedfleet-ascend:0.1.0"
    """Image with CANN >= 8.1.RC1, torch-npu, vllm-ascend and Ray; placeholder to replace."""
    cluster_name: str | None = None
    """Ray cluster / RayService name; None = the config's app_name."""
    cards_per_node: int | None = None
    """NPUs each worker advertises; None = the config's ``cards``."""
    head_ip: str = "192.0.2.10"
    """Launcher only. TEST-NET-1 documentation addresses: replace with the real nodes."""
    worker_ips: tuple[str, ...] | None = None
    """Launcher only; None = placeholders, as many as the config's replicas need."""
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


# -- Ray cluster launcher ---------------------------------------------------------------------

def cluster_launcher_config(cfg: EmbedfleetConfig,
                            spec: AscendClusterSpec | None = None) -> dict[str, Any]:
    """The cluster-launcher config as data (see ``render_cluster_launcher``)."""
    _require_ascend(cfg)
    spec = spec or AscendClusterSpec()
    cards = cards_per_node(cfg, spec)
    _, max_workers = worker_bounds(cfg, spec)
    workers = list(spec.worker_ips or [f"192.0.2.{11 + i}" for i in range(max_workers)])
    env_opts = [f"-e {k}={v}" for k, v in ASCEND_ENV.items()]
    devices = [f"--device=/dev/davinci{i}" for i in range(cards)]
    devices += [f"--device={d}" for d in ASCEND_MANAGEMENT_DEVICES]
    driver = [f"-v {p}:{p}:ro" for p in ASCEND_DRIVER_MOUNTS]
    source_cann = " && ".join(f"source {s}" for s in spec.cann_set_env)
    return {
        "cluster_name": spec.cluster_name or cfg.app_name,
        # Manually managed on-premises nodes: Ray keeps every listed worker in the cluster. The
        # local provider takes no available_node_types (`ray up` refuses them), so the head/worker
        # split is made by the `ray start --resources` below.
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
        # embedfleet itself, so `deployments.app:build_app` imports on every node.
        "setup_commands": ["cd ~/embedfleet && pip install --no-cache-dir '.[ascend]'"],
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
    spec = spec or AscendClusterSpec()
    cards = cards_per_node(cfg, spec)
    min_workers, max_workers = worker_bounds(cfg, spec)
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
        }},
    }
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": spec.cluster_name or cfg.app_name, "labels": dict(spec.labels)},
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


def render_cluster_launcher(cfg: EmbedfleetConfig, spec: AscendClusterSpec | None = None) -> str:
    """Ray cluster-launcher YAML for 910B nodes: head without cards, workers with NPU: N."""
    header = ("# Generated by cluster/manifests.py from the embedfleet config; do not edit.\n"
              "# Replace the placeholders (image, head_ip, worker_ips, ssh key), then from the\n"
              "# repository root: ray up <this file>; then deploy the Serve config.\n")
    return _dump(header, cluster_launcher_config(cfg, spec))


def render_rayservice(cfg: EmbedfleetConfig, spec: AscendClusterSpec | None = None) -> str:
    """KubeRay RayService YAML: serveConfigV2 from the config, device-plugin cards as NPU."""
    header = ("# Generated by cluster/manifests.py from the embedfleet config; do not edit.\n"
              "# Replace the image placeholder, then: kubectl apply -f <this file>\n")
    return _dump(header, rayservice_manifest(cfg, spec))


# -- the checked-in examples ------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES_DIR = Path(__file__).resolve().parent / "examples"
ASCEND_910B_CONFIG = REPO_ROOT / "deployments" / "configs" / "ascend-910b-qwen3-embedding-8b.yaml"
LOCAL_CPU_CONFIG = REPO_ROOT / "deployments" / "configs" / "local-cpu.yaml"


def example_files() -> dict[str, str]:
    """File name under ``cluster/examples/`` -> its rendered text (the golden tests' truth)."""
    ascend = load_config(ASCEND_910B_CONFIG)
    return {
        "ray-cluster-910b.yaml": render_cluster_launcher(ascend),
        "rayservice-910b.yaml": render_rayservice(ascend),
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


if __name__ == "__main__":  # python -m cluster.manifests: regenerate the examples
    for p in write_examples():
        print(p.relative_to(REPO_ROOT), file=sys.stdout)
