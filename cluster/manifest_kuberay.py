"""The KubeRay ``RayService`` for 910B nodes on Kubernetes with the Ascend device plugin, as data.

Its ``serveConfigV2`` is the rendered Serve config (``embedfleet.cluster.render.serve_config``).
The head pod advertises no cards (``NPU: 0``), so no engine replica lands on it; each worker pod
gets its cards from the device plugin and advertises them as Ray's ``NPU`` resource. How many
worker pods follows from the models' replica bounds (``manifest_spec.worker_bounds``).
What closes it (Ray's token, the API keys Secret, pod security, the NetworkPolicy, GCS fault
tolerance) comes from ``manifest_security.py``; ``kuberay_manifests`` is every object
``manifests.render_rayservice`` turns into YAML text.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from .manifest_security import (cluster_router_data, container_security,
                                gcs_fault_tolerance, hf_volumes,
                                keys_mounted, keys_volume, pod_labels, pod_security,
                                ray_network_policy, redis_manifests,
                                shm_volume)
from .manifest_spec import (ASCEND_ENV, DASHBOARD_PORT, HEAD_PORT,
                            METRICS_PORT, RAY_VERSION,
                            AscendClusterSpec, cards_per_node, cluster_spec,
                            require_ascend, require_given, resources_json,
                            worker_bounds)
from .render import serve_config
from ..deployments.config.schema import ConfigError, EmbedfleetConfig
from ..deployments.config.router import RouterConfig
from ..deployments.config.ray_options import ray_head_env, ray_node_env


def _ray_start_resources(cfg: EmbedfleetConfig, cards: int) -> str:
    """KubeRay's quoting of the `resources` rayStartParam: '"{\\"NPU\\": 8}"' in the YAML."""
    return '"' + resources_json(cfg, cards).replace('"', '\\"') + '"'


def _env(cfg: EmbedfleetConfig) -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in {**ASCEND_ENV, **ray_node_env(cfg)}.items()]


def _sizes(cpu: str, memory: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    want = {"cpu": cpu, "memory": memory, **(extra or {})}
    return {"limits": dict(want), "requests": dict(want)}


_SHM_MOUNT = {"name": "dshm", "mountPath": "/dev/shm"}


def kuberay_config(cfg: EmbedfleetConfig) -> EmbedfleetConfig:
    """The config the RayService deploys: the router bound to the pod's interfaces and reading
    the API keys Secret (``manifest_security.cluster_router_data``)."""
    return cfg.model_copy(update={
        "router": RouterConfig.model_validate(cluster_router_data(cfg))})


def rayservice_manifest(cfg: EmbedfleetConfig,
                        spec: AscendClusterSpec | None = None) -> dict[str, Any]:
    """The RayService as data (see ``manifests.render_rayservice``)."""
    require_ascend(cfg)
    spec = spec or cluster_spec(cfg)
    require_given(spec, "--kuberay", "image")
    name = rayservice_name(cfg, spec)
    cards = cards_per_node(cfg, spec)
    min_workers, max_workers = worker_bounds(cfg, spec)
    worker_selector = dict(spec.node_selector)
    head_selector = worker_selector if spec.head_node_selector is None \
        else dict(spec.head_node_selector)
    keys = [keys_volume(name)] if keys_mounted(cfg) else []
    hf = hf_volumes(spec.hf_cache_host_path)
    labels = pod_labels(name)
    head = {
        # A ClusterIP Service only: the dashboard, GCS and client ports are never published
        # outside the cluster; the NetworkPolicy narrows who inside may reach them.
        "serviceType": "ClusterIP",
        "rayStartParams": {
            # The pod's interfaces, not a host's: KubeRay's own probes read the dashboard on
            # localhost and its operator through the head Service, so it must listen on both;
            # the NetworkPolicy admits only the operator's pods, and Ray's token guards it.
            "dashboard-host": "0.0.0.0",
            "resources": _ray_start_resources(cfg, 0),  # no engine replica on the head
            "object-store-memory": str(_object_store_bytes(spec.head_shm)),
        },
        "template": {"metadata": {"labels": dict(labels)}, "spec": {
            "securityContext": pod_security(worker=False),
            "containers": [{
                "name": "ray-head",
                "image": spec.image,
                "resources": _sizes(spec.head_cpu, spec.head_memory),
                "env": [{"name": k, "value": v} for k, v in ray_head_env(cfg).items()],
                "ports": [
                    {"containerPort": HEAD_PORT, "name": "gcs-server"},
                    {"containerPort": DASHBOARD_PORT, "name": "dashboard"},
                    {"containerPort": cfg.router.port, "name": "serve"},
                    {"containerPort": METRICS_PORT, "name": "metrics"},
                ],
                "securityContext": container_security(worker=False),
                "volumeMounts": [dict(_SHM_MOUNT), *(m for _, m in keys)],
            }],
            "volumes": [shm_volume(spec.head_shm), *(v for v, _ in keys)],
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
        "rayStartParams": {"resources": _ray_start_resources(cfg, cards),
                           "object-store-memory": str(_object_store_bytes(spec.worker_shm))},
        "template": {"metadata": {"labels": dict(labels)}, "spec": {
            "securityContext": pod_security(worker=True),
            "containers": [{
                "name": "ray-worker",
                "image": spec.image,
                "resources": _sizes(spec.worker_cpu, spec.worker_memory,
                                    {spec.device_plugin_resource: cards}),
                "env": _env(cfg),
                "ports": [{"containerPort": METRICS_PORT, "name": "metrics"}],
                "securityContext": container_security(worker=True),
                "volumeMounts": [dict(_SHM_MOUNT), *(m for _, m in hf),
                                 *(m for _, m in keys)],
            }],
            "volumes": [shm_volume(spec.worker_shm), *(v for v, _ in hf),
                        *(v for v, _ in keys)],
            **({"nodeSelector": worker_selector} if worker_selector else {}),
        }},
    }
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name, **_namespace(spec), "labels": dict(spec.labels)},
        "spec": {
            "serveConfigV2": serve_config_v2(kuberay_config(cfg)),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                # Ray's token auth on every container, the token in a Secret KubeRay makes
                # (KubeRay >= 1.5.1, Ray >= 2.52).
                "authOptions": {"mode": "token"},
                "gcsFaultToleranceOptions": gcs_fault_tolerance(name, spec),
                # Worker pods only need to come and go when the replica bounds span nodes.
                "enableInTreeAutoscaling": min_workers < max_workers,
                "headGroupSpec": head,
                "workerGroupSpecs": [worker],
            },
        },
    }


def rayservice_name(cfg: EmbedfleetConfig, spec: AscendClusterSpec) -> str:
    name = spec.cluster_name or cfg.app_name
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 47:
        raise ConfigError(f"RayService name {name!r} (app_name) is not a DNS-1035 label of at most "
                          "47 characters, as KubeRay requires: set cluster.name in the config")
    return name


def _namespace(spec: AscendClusterSpec) -> dict[str, str]:
    return {"namespace": spec.namespace} if spec.namespace else {}


def _object_store_bytes(shm: str) -> int:
    """Ray's object store: 80% of the /dev/shm bound, so Ray's own files there still fit."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    number, unit = shm[:-2], shm[-2:]
    return int(float(number) * units[unit] * 0.8)


def kuberay_manifests(cfg: EmbedfleetConfig,
                      spec: AscendClusterSpec | None = None) -> list[dict[str, Any]]:
    """Every object ``render --kuberay`` prints: the GCS's Redis (unless the config names one),
    the Ray pods' NetworkPolicy, and the RayService. The Secrets are the operator's."""
    spec = spec or cluster_spec(cfg)
    service = rayservice_manifest(cfg, spec)
    name = service["metadata"]["name"]
    return [*redis_manifests(name, spec, _namespace(spec)),
            ray_network_policy(cfg, name, spec, _namespace(spec)), service]


def serve_config_v2(cfg: EmbedfleetConfig) -> str:
    """The Serve config KubeRay deploys: ``serve_config(cfg)`` as YAML text."""
    return yaml.safe_dump(serve_config(cfg), sort_keys=False)
