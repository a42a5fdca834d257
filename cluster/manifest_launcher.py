"""The Ray cluster-launcher config (``ray up``) for on-premises 910B nodes, as data.

910B servers are bought, not rented from a cloud Ray has a node provider for, so this is Ray's
``local`` provider: nodes reached over SSH, each running the embedfleet image in Docker. The head
advertises no cards (``NPU: 0``), so no engine replica lands on it; each worker advertises its
cards as Ray's ``NPU`` resource. Ray's token auth is on, the dashboard on the head's loopback,
and the token and API keys file are synced to every node (``manifest_security.py``).
``manifests.render_cluster_launcher`` turns it into YAML text.
"""

from __future__ import annotations

import shlex
from typing import Any

from .manifest_spec import (ASCEND_DRIVER_MOUNTS, ASCEND_ENV,
                            ASCEND_MANAGEMENT_DEVICES, HEAD_PORT,
                            HF_HUB_CACHE_IN_CONTAINER, METRICS_PORT,
                            AscendClusterSpec, cards_per_node, cluster_spec,
                            require_ascend, require_given, resources_json)
from .manifest_security import (AUTH_EXPORT, RAY_TOKEN_ENV,
                                launcher_redis_env, launcher_redis_flag,
                                launcher_secret_mounts)
from ..deployments.config.schema import ConfigError, EmbedfleetConfig
from ..deployments.config.router import is_loopback
from ..deployments.config.ray_options import ray_head_env, ray_node_env


def cluster_launcher_config(cfg: EmbedfleetConfig,
                            spec: AscendClusterSpec | None = None) -> dict[str, Any]:
    """The cluster-launcher config as data (see ``manifests.render_cluster_launcher``)."""
    require_ascend(cfg)
    spec = spec or cluster_spec(cfg)
    require_given(spec, "--ray-cluster", "image", "head_ip", "worker_ips")
    if is_loopback(cfg.router.host):
        # each node's HAProxy reaches a Router replica on another machine at its node address
        raise ConfigError(
            f"--ray-cluster: router.host={cfg.router.host!r} is loopback, so an ingress replica "
            "on one node cannot be reached from another node's HAProxy: set router.host: "
            "0.0.0.0 with router.api_keys_file (synced to every node)")
    if cfg.router.api_keys_env:
        raise ConfigError(
            f"--ray-cluster: router.api_keys_env={cfg.router.api_keys_env!r} has no value on the "
            "launcher's nodes (their `ray start` environment is rendered here), so every ingress "
            "replica would refuse to start: use router.api_keys_file, which `ray up` syncs to "
            "every node")
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
    node_env = "".join(f"{k}={shlex.quote(v)} " for k, v in ray_node_env(cfg).items())
    token_env = "".join(f"{k}={shlex.quote(v)} " for k, v in RAY_TOKEN_ENV.items())
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
            # The weights are read, never written (HF_HUB_OFFLINE=1): read-only, as HF_HUB_CACHE;
            # HF_HOME, which Hugging Face's libraries write to, is in the container's own files.
            + [f"-v {spec.hf_cache_host_path}:{HF_HUB_CACHE_IN_CONTAINER}:ro"],
        },
        # Ray's token and the API keys travel with `ray up` to every node (docs/security.md).
        "file_mounts": {"~/embedfleet": spec.repo_dir, **launcher_secret_mounts(cfg, spec)},
        "rsync_exclude": [".venv", ".git", "**/__pycache__", ".embedfleet", "benchmarks/results"],
        # The image already carries the heavy pins (vllm-ascend, torch-npu); this installs
        # embedfleet itself, so `embedfleet.deployments.app:build_app` imports on every node.
        # vllm-ascend and vLLM are built from source (cluster/install_ascend.sh); `make setup`
        # is idempotent, so with the image's stack already built it only installs embedfleet.
        # RAY_AUTH_MODE in the login shell too: `ray exec` / `ray attach` commands (serve
        # deploy, status) then talk to the token-guarded cluster as its nodes do.
        "setup_commands": [f"grep -qx '{AUTH_EXPORT}' ~/.bashrc || echo '{AUTH_EXPORT}' >> "
                           "~/.bashrc",
                           "cd ~/embedfleet && make setup EXTRAS=ascend"],
        "head_start_ray_commands": [
            "ray stop",
            # Serve's controller reads these from the head's environment (options.ray_head_env).
            # Ray's token auth; the dashboard (job submission) on loopback: reach it through
            # `ray dashboard <this file>`, an SSH tunnel.
            " ".join(f"{k}={shlex.quote(v)}" for k, v in {
                **RAY_TOKEN_ENV, **ray_head_env(cfg), **launcher_redis_env(spec)}.items())
            + f" ray start --head --port={HEAD_PORT} --dashboard-host=127.0.0.1 "
            f"--metrics-export-port={METRICS_PORT} --resources='{resources_json(cfg, 0)}' "
            f"{launcher_redis_flag(spec)}--autoscaling-config=~/ray_bootstrap_config.yaml",
        ],
        "worker_start_ray_commands": [
            "ray stop",
            # Replicas inherit this shell's environment: CANN's set_env.sh must run here.
            f"{source_cann} && {token_env}{node_env}ray start --address=$RAY_HEAD_IP:{HEAD_PORT} "
            f"--metrics-export-port={METRICS_PORT} --resources='{resources_json(cfg, cards)}'",
        ],
    }
