"""Cluster artefacts for 910B nodes: golden examples, Ray's own validators, embedded Serve config.

Schema-level only: nothing here starts Ray, Docker or Kubernetes. Where Ray ships the code that
reads an artefact (the cluster launcher's config preparation, KubeRay's autoscaler translation of
a RayCluster, Serve's deploy schema), the test runs that code instead of re-stating its rules.
After a deliberate change to the config or a renderer, regenerate the examples with
``python -m cluster.manifests``.
"""

from __future__ import annotations

import copy
import json
import shlex

import pytest
import ray
import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.manifests import (
    ASCEND_910B_CONFIG,
    EXAMPLES_DIR,
    LOCAL_CPU_CONFIG,
    RAY_VERSION,
    AscendClusterSpec,
    cluster_launcher_config,
    example_files,
    rayservice_manifest,
    render_cluster_launcher,
    render_rayservice,
    worker_bounds,
)
from cluster.render import serve_config
from deployments.config import CONFIG_DIR, load_config

ASCEND = load_config(ASCEND_910B_CONFIG)
NPU_RESOURCE = "huawei.com/Ascend910"


@pytest.fixture(scope="module")
def launcher() -> dict:
    return yaml.safe_load(render_cluster_launcher(ASCEND))


@pytest.fixture(scope="module")
def rayservice() -> dict:
    return yaml.safe_load(render_rayservice(ASCEND))


def _flag(command: str, name: str) -> str:
    """The value of --name=value in a shell command line (after shell unquoting)."""
    for word in shlex.split(command):
        if word.startswith(f"--{name}="):
            return word.split("=", 1)[1]
    raise AssertionError(f"--{name} not in {command!r}")


# -- golden -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(example_files()))
def test_checked_in_example_equals_render(name):
    path = EXAMPLES_DIR / name
    assert path.exists(), f"{path} missing; run python -m cluster.manifests"
    assert path.read_text() == example_files()[name], (
        f"{path} differs from the render; run python -m cluster.manifests and review the diff")


def test_examples_readme_names_every_example():
    readme = (EXAMPLES_DIR / "README.md").read_text()
    for name in example_files():
        assert name in readme


# -- the 910B Serve config --------------------------------------------------------------------

def test_910b_serve_config_carries_the_seed_values():
    app = yaml.safe_load((EXAMPLES_DIR / "serve-910b.yaml").read_text())["applications"][0]
    model = app["args"]["config"]["models"][0]
    assert app["args"]["config"]["platform"]["kind"] == "ascend"
    assert model["source"] == {"hub_id": "Qwen/Qwen3-Embedding-8B"}
    assert model["max_model_len"] == 32768
    assert model["dtype"] == "bfloat16"
    assert model["engine"]["block_size"] == 64
    assert model["engine"]["gpu_memory_utilization"] == 0.95
    assert model["engine"]["max_num_batched_tokens"] == 65536
    engine = next(d for d in app["deployments"] if d["name"].startswith("engine-"))
    assert engine["ray_actor_options"]["resources"] == {"NPU": 1}
    assert engine["autoscaling_config"]["min_replicas"] == 1
    assert engine["autoscaling_config"]["max_replicas"] == 8


def test_910b_engine_kwargs_carry_the_seed_values():
    m = ASCEND.models[0]
    kw = ASCEND.engine_kwargs(m, enable_prefix_caching=False)
    assert (kw["model"], kw["max_model_len"], kw["dtype"], kw["block_size"]) == (
        "Qwen/Qwen3-Embedding-8B", 32768, "bfloat16", 64)
    assert (kw["gpu_memory_utilization"], kw["max_num_batched_tokens"]) == (0.95, 65536)
    assert m.prefix_cache == "auto"


# Every bundled config rendering a valid Serve config is tests/test_config.py's job.

def test_cuda_config_asks_for_gpus():
    cfg = load_config(CONFIG_DIR / "cuda-qwen3-embedding-0.6b.yaml")
    engine = serve_config(cfg)["applications"][0]["deployments"][-1]
    assert engine["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}
    assert cfg.models[0].source.hub_id == "Qwen/Qwen3-Embedding-0.6B"


# -- cluster launcher -------------------------------------------------------------------------

def test_launcher_required_fields(launcher):
    assert launcher["cluster_name"] == "embedfleet"
    assert launcher["provider"]["type"] == "local"
    assert launcher["provider"]["head_ip"]
    assert len(launcher["provider"]["worker_ips"]) == 1  # 8 replicas max / 8 cards per node
    assert launcher["docker"]["image"]
    assert any("embedfleet" in c and "[ascend]" in c for c in launcher["setup_commands"])


def test_launcher_head_has_no_cards_and_workers_have_eight(launcher):
    head = launcher["head_start_ray_commands"][-1]
    worker = launcher["worker_start_ray_commands"][-1]
    assert "--head" in head
    assert json.loads(_flag(head, "resources")) == {"NPU": 0}
    assert json.loads(_flag(worker, "resources")) == {"NPU": 8}
    assert "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in worker  # before ray start
    assert worker.index("set_env.sh") < worker.index("ray start")


def test_launcher_mounts_cards_and_sets_ascend_env_on_workers_only(launcher):
    docker = launcher["docker"]
    assert "run_options" not in docker and "head_run_options" not in docker
    opts = docker["worker_run_options"]
    assert [o for o in opts if o.startswith("--device=/dev/davinci") and o[-1].isdigit()] == [
        f"--device=/dev/davinci{i}" for i in range(8)]
    for node in ("davinci_manager", "devmm_svm", "hisi_hdc"):
        assert f"--device=/dev/{node}" in opts
    assert "-e PYTORCH_NPU_ALLOC_CONF=expandable_segments:True" in opts


def test_launcher_passes_rays_own_preparation_and_schema(launcher):
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(launcher))
    validate_config(prepared)
    # Ray turns an on-premises config into one node type with every listed worker kept.
    assert prepared["head_node_type"] in prepared["available_node_types"]
    node_type = prepared["available_node_types"][prepared["head_node_type"]]
    assert node_type["min_workers"] == node_type["max_workers"] == 1


def test_launcher_cannot_declare_node_types_on_premises(launcher):
    """Why the head/worker split lives in `ray start --resources`: `ray up` refuses node types
    for the local provider, the only one that reaches 910B servers."""
    from click import ClickException
    from ray.autoscaler._private.util import prepare_config

    bad = copy.deepcopy(launcher)
    bad["available_node_types"] = {"head": {"node_config": {}, "resources": {"NPU": 0}}}
    bad["head_node_type"] = "head"
    with pytest.raises(ClickException, match="available_node_types is not supported"):
        prepare_config(bad)


# -- KubeRay RayService -----------------------------------------------------------------------

def test_rayservice_required_fields(rayservice):
    assert rayservice["apiVersion"] == "ray.io/v1"
    assert rayservice["kind"] == "RayService"
    assert rayservice["metadata"]["name"] == "embedfleet"
    spec = rayservice["spec"]
    assert isinstance(spec["serveConfigV2"], str)
    cluster = spec["rayClusterConfig"]
    assert cluster["rayVersion"] == RAY_VERSION
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert len(cluster["workerGroupSpecs"]) == 1


def test_rayservice_serve_config_equals_the_render(rayservice):
    embedded = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    assert embedded == serve_config(ASCEND)
    assert embedded == yaml.safe_load((EXAMPLES_DIR / "serve-910b.yaml").read_text())
    ServeDeploySchema.model_validate(embedded)


def test_rayservice_workers_map_device_plugin_cards_to_npu(rayservice):
    worker = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    container = worker["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"][NPU_RESOURCE] == 8
    assert container["resources"]["requests"][NPU_RESOURCE] == 8
    assert worker["rayStartParams"]["resources"] == '"{\\"NPU\\": 8}"'
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    assert (worker["minReplicas"], worker["maxReplicas"]) == (1, 1)


def test_rayservice_head_has_no_cards(rayservice):
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    container = head["template"]["spec"]["containers"][0]
    assert NPU_RESOURCE not in container["resources"]["limits"]
    assert head["rayStartParams"]["resources"] == '"{\\"NPU\\": 0}"'
    assert {"containerPort": 8000, "name": "serve"} in container["ports"]


def test_rayservice_cluster_reads_as_ray_autoscaler_sees_it(rayservice):
    """KubeRay's autoscaler derives node types from the RayCluster spec with this Ray code."""
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )

    ray_cluster = {"metadata": {"name": "embedfleet", "namespace": "default"},
                   "spec": rayservice["spec"]["rayClusterConfig"]}
    types = _derive_autoscaling_config_from_ray_cr(ray_cluster)["available_node_types"]
    assert types["headgroup"]["resources"]["NPU"] == 0
    assert types["ascend-910b"]["resources"]["NPU"] == 8
    assert types["ascend-910b"]["resources"]["CPU"] == 64


def test_ray_version_matches_the_installed_ray():
    assert RAY_VERSION == ray.__version__


# -- derived sizes and guards -----------------------------------------------------------------

def _with_replicas(min_r: int, max_r: int):
    m = ASCEND.models[0]
    reps = m.replicas.model_copy(update={"min_replicas": min_r, "max_replicas": max_r})
    return ASCEND.model_copy(update={"models": [m.model_copy(update={"replicas": reps})]})


def test_worker_nodes_follow_replica_bounds():
    cfg = _with_replicas(3, 20)
    assert worker_bounds(cfg, AscendClusterSpec()) == (1, 3)
    worker = rayservice_manifest(cfg)["spec"]["rayClusterConfig"]
    assert worker["enableInTreeAutoscaling"] is True
    assert (worker["workerGroupSpecs"][0]["minReplicas"],
            worker["workerGroupSpecs"][0]["maxReplicas"]) == (1, 3)
    assert len(cluster_launcher_config(cfg)["provider"]["worker_ips"]) == 3


def test_spec_overrides_reach_the_manifests():
    spec = AscendClusterSpec(image="swr.example/emb:1", cards_per_node=4,
                             worker_ips=("10.0.0.2", "10.0.0.3"), cluster_name="emb-prod")
    launcher = cluster_launcher_config(ASCEND, spec)
    assert launcher["provider"]["worker_ips"] == ["10.0.0.2", "10.0.0.3"]
    assert json.loads(_flag(launcher["worker_start_ray_commands"][-1], "resources")) == {"NPU": 4}
    svc = rayservice_manifest(ASCEND, spec)
    worker = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert worker["template"]["spec"]["containers"][0]["image"] == "swr.example/emb:1"
    assert worker["maxReplicas"] == 2  # 8 replicas over 4-card nodes
    assert svc["metadata"]["name"] == "emb-prod"


def test_non_ascend_config_is_refused():
    with pytest.raises(ValueError, match="platform.kind='cpu'"):
        render_rayservice(load_config(LOCAL_CPU_CONFIG))
    with pytest.raises(ValueError, match="platform.kind='cpu'"):
        render_cluster_launcher(load_config(LOCAL_CPU_CONFIG))
