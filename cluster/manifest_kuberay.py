"""The KubeRay ``RayService`` for 910B nodes on Kubernetes with the Ascend device plugin, as data.

Its ``serveConfigV2`` is the rendered Serve config (``embedfleet.cluster.render.serve_config``).
The head pod advertises no cards (``NPU: 0``), so no engine replica lands on it; each worker pod
gets its cards from the device plugin and advertises them as Ray's ``NPU`` resource. How many
worker pods follows from the models' replica bounds (``manifest_spec.worker_bounds``).
``manifests.render_rayservice`` turns it into YAML text.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from embedfleet.cluster.manifest_spec import (ASCEND_ENV, CLIENT_PORT, DASHBOARD_PORT, HEAD_PORT,
                                              HF_HOME_IN_CONTAINER, METRICS_PORT, RAY_VERSION,
                                              AscendClusterSpec, cards_per_node, cluster_spec,
                                              require_ascend, require_given, resources_json,
                                              worker_bounds)
from embedfleet.cluster.render import serve_config
from embedfleet.deployments.config import ConfigError, EmbedfleetConfig
from embedfleet.deployments.options import ray_head_env, ray_node_env


def _ray_start_resources(cfg: EmbedfleetConfig, cards: int) -> str:
    """KubeRay's quoting of the `resources` rayStartParam: '"{\\"NPU\\": 8}"' in the YAML."""
    return '"' + resources_json(cfg, cards).replace('"', '\\"') + '"'


def _env(cfg: EmbedfleetConfig) -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in {**ASCEND_ENV, **ray_node_env(cfg)}.items()]


def _sizes(cpu: str, memory: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    want = {"cpu": cpu, "memory": memory, **(extra or {})}
    return {"limits": dict(want), "requests": dict(want)}


# Ray's object store lives in /dev/shm; a pod's default 64 MB would push it to disk.
_SHM_VOLUME = {"name": "dshm", "emptyDir": {"medium": "Memory"}}
_SHM_MOUNT = {"name": "dshm", "mountPath": "/dev/shm"}


def rayservice_manifest(cfg: EmbedfleetConfig,
                        spec: AscendClusterSpec | None = None) -> dict[str, Any]:
    """The RayService as data (see ``manifests.render_rayservice``)."""
    require_ascend(cfg)
    spec = spec or cluster_spec(cfg)
    require_given(spec, "--kuberay", "image")
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
                "env": [{"name": k, "value": v} for k, v in ray_head_env(cfg).items()],
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
                "env": _env(cfg),
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
