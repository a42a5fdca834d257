"""Cluster artefacts for 910B nodes: golden examples, Ray's own validators, embedded Serve config.

Schema-level only: nothing here starts Ray, Docker or Kubernetes. Where Ray ships the code that
reads an artefact (the cluster launcher's config preparation, KubeRay's autoscaler translation of
a RayCluster, Serve's deploy schema), the test runs that code instead of re-stating its rules.
After a deliberate change to the config or a renderer, regenerate the examples with
``python -m embedfleet.cluster.manifests``.
"""

from __future__ import annotations

import copy
import json
import shlex

import pytest
import ray
import yaml
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from ray.serve.schema import ServeDeploySchema

from embedfleet.cluster.cli import main
from embedfleet.cluster.manifest_kuberay import kuberay_config, rayservice_manifest
from embedfleet.cluster.manifest_security import KEYS_FILE_IN_POD, RAY_TOKEN_ENV
from embedfleet.cluster.manifest_launcher import cluster_launcher_config
from embedfleet.cluster.manifest_spec import (
    EXAMPLE_IMAGE,
    RAY_VERSION,
    AscendClusterSpec,
    cluster_spec,
    worker_bounds,
)
from embedfleet.cluster.manifests import (
    ASCEND_910B_CONFIG,
    EXAMPLES_DIR,
    LOCAL_CPU_CONFIG,
    example_files,
    render_cluster_launcher,
    render_rayservice,
)
from embedfleet.cluster.render import config_from_serve_yaml, render_yaml, serve_config
from embedfleet.deployments.config.schema import CONFIG_DIR, ConfigError, load_config, parse_config
from embedfleet.deployments.engine.ascend_release import CANN_VERSION
from embedfleet.deployments.config.ray_options import ray_head_env, ray_node_env

ASCEND = load_config(ASCEND_910B_CONFIG)
EXAMPLE = cluster_spec(ASCEND, example=True)  # what the checked-in examples are rendered with
NPU_RESOURCE = "huawei.com/Ascend910"


@pytest.fixture(scope="module")
def launcher() -> dict:
    return yaml.safe_load(render_cluster_launcher(ASCEND, EXAMPLE))


@pytest.fixture(scope="module")
def rayservice() -> dict:
    return rayservice_of(render_rayservice(ASCEND, EXAMPLE))


def rayservice_of(text: str) -> dict:
    """The RayService among the documents ``render --kuberay`` prints."""
    (svc,) = [d for d in yaml.safe_load_all(text) if d["kind"] == "RayService"]
    return svc


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
    assert path.exists(), f"{path} missing; run python -m embedfleet.cluster.manifests"
    assert path.read_text() == example_files()[name], (
        f"{path} differs from the render; run python -m embedfleet.cluster.manifests and review the diff")


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
    assert any("embedfleet" in c and "EXTRAS=ascend" in c for c in launcher["setup_commands"])


def test_launcher_head_has_no_cards_and_workers_have_eight(launcher):
    head = launcher["head_start_ray_commands"][-1]
    worker = launcher["worker_start_ray_commands"][-1]
    assert "--head" in head
    assert json.loads(_flag(head, "resources")) == {"NPU": 0}
    assert json.loads(_flag(worker, "resources")) == {"NPU": 8}
    assert "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in worker  # before ray start
    assert worker.index("set_env.sh") < worker.index("ray start")
    # Serve's controller runs on the head and reads the proxy health-check period from its env
    assert _env_before_ray_start(head) == {**RAY_TOKEN_ENV, **ray_head_env(ASCEND)}
    assert _env_before_ray_start(head)["RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S"] == "2"
    # every node agrees on HAProxy mode and its replay policy (a value with spaces and a newline
    # stays one word)
    assert _env_before_ray_start(worker.split(" && ")[-1]) == {**RAY_TOKEN_ENV,
                                                                **ray_node_env(ASCEND)}
    assert "\n" in ray_node_env(ASCEND)["RAY_SERVE_HAPROXY_RETRY_ON"]


def _env_before_ray_start(command: str) -> dict[str, str]:
    """The VAR=value words a shell command sets in front of `ray start` (after unquoting)."""
    words = shlex.split(command)
    return dict(w.split("=", 1) for w in words[:words.index("ray")])


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
    """The config's Serve render, but reading the API keys Secret mounted on every pod."""
    embedded = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    assert embedded == serve_config(kuberay_config(ASCEND))
    router = embedded["applications"][0]["args"]["config"]["router"]
    assert router["api_keys_file"] == KEYS_FILE_IN_POD and router["host"] == "0.0.0.0"
    router["api_keys_file"] = ASCEND.router.api_keys_file
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


def test_ray_version_is_the_ascend_extras_pin():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert f"ray[serve,data]=={RAY_VERSION}" in extras["ascend"]
    assert RAY_VERSION != ray.__version__  # the CPU stack (this venv) runs another Ray


# -- derived sizes and guards -----------------------------------------------------------------

def _with_replicas(min_r: int, max_r: int):
    m = ASCEND.models[0]
    reps = m.replicas.model_copy(update={"min_replicas": min_r, "max_replicas": max_r})
    return ASCEND.model_copy(update={"models": [m.model_copy(update={"replicas": reps})]})


def test_worker_nodes_follow_replica_bounds():
    cfg = _with_replicas(3, 20)
    assert worker_bounds(cfg, AscendClusterSpec()) == (1, 3)
    example = cluster_spec(cfg, example=True)
    worker = rayservice_manifest(cfg, example)["spec"]["rayClusterConfig"]
    assert worker["enableInTreeAutoscaling"] is True
    assert (worker["workerGroupSpecs"][0]["minReplicas"],
            worker["workerGroupSpecs"][0]["maxReplicas"]) == (1, 3)
    assert len(cluster_launcher_config(cfg, example)["provider"]["worker_ips"]) == 3


def test_spec_overrides_reach_the_manifests():
    spec = AscendClusterSpec(image="swr.example/emb:1", cards_per_node=4, head_ip="10.0.0.1",
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


# -- where the cluster runs: the config's `cluster` section and the render flags ----------------

IMAGE = "swr.cn-south-1.myhuaweicloud.com/emb/embedfleet-ascend:0.1.0"
CLUSTER = {
    "image": IMAGE,
    "name": "emb-prod",
    "namespace": "embeddings",
    "head_address": "10.0.0.1",
    "worker_addresses": ["10.0.0.2", "npu-03.lab.internal"],
    "node_selector": {"accelerator": "huawei-Ascend910", "node.kubernetes.io/instance-type": "a2"},
    "ssh_user": "ops",
    "ssh_private_key": "~/.ssh/embedfleet",
}


def _ascend_data(**cluster) -> dict:
    return {**yaml.safe_load(ASCEND_910B_CONFIG.read_text()), "cluster": cluster}


@pytest.fixture
def cluster_config(tmp_path):
    """The 910B config with a full `cluster` section, as a file the CLI can read."""
    path = tmp_path / "ascend-with-cluster.yaml"
    path.write_text(yaml.safe_dump(_ascend_data(**CLUSTER), sort_keys=False))
    return path


def _pods(svc: dict) -> tuple[dict, dict]:
    """(head, worker) pod specs of a rendered RayService."""
    ray_cluster = svc["spec"]["rayClusterConfig"]
    return (ray_cluster["headGroupSpec"]["template"]["spec"],
            ray_cluster["workerGroupSpecs"][0]["template"]["spec"])


def _render(capsys, *argv: str) -> tuple[int, str, str]:
    """`embedfleet render ...` in-process: (exit code, stdout, stderr). Ray may print import
    noise on stderr; assertions on the output look at stdout."""
    try:
        code = main(["render", *argv])
    except SystemExit as exc:  # argparse rejects a flag value with exit 2
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_config_cluster_section_reaches_the_rayservice(cluster_config):
    cfg = load_config(cluster_config)
    svc = rayservice_of(render_rayservice(cfg, cluster_spec(cfg)))
    head, worker = _pods(svc)
    assert svc["metadata"]["name"] == "emb-prod"
    assert svc["metadata"]["namespace"] == "embeddings"
    assert [c["image"] for c in head["containers"] + worker["containers"]] == [IMAGE, IMAGE]
    assert worker["nodeSelector"] == CLUSTER["node_selector"]
    assert head["nodeSelector"] == CLUSTER["node_selector"]  # head_node_selector unset = same


def test_config_cluster_section_reaches_the_launcher(cluster_config):
    cfg = load_config(cluster_config)
    text = render_cluster_launcher(cfg, cluster_spec(cfg))
    launcher = yaml.safe_load(text)
    assert launcher["provider"] == {"type": "local", "head_ip": "10.0.0.1",
                                    "worker_ips": ["10.0.0.2", "npu-03.lab.internal"]}
    assert launcher["max_workers"] == 2
    assert launcher["docker"]["image"] == IMAGE
    assert launcher["auth"] == {"ssh_user": "ops", "ssh_private_key": "~/.ssh/embedfleet"}
    assert launcher["cluster_name"] == "emb-prod"
    # The launcher has no selector concept: nowhere in the data, said so in the header.
    assert "huawei-Ascend910" not in yaml.safe_dump(launcher)
    assert "node_selector is not applied" in text
    assert "EXAMPLE" not in text and "192.0.2." not in text


def test_head_node_selector_can_free_the_head_from_card_nodes():
    cfg = parse_config(_ascend_data(image=IMAGE, node_selector={"accelerator": "ascend"},
                                    head_node_selector={}))
    head, worker = _pods(rayservice_manifest(cfg, cluster_spec(cfg)))
    assert "nodeSelector" not in head
    assert worker["nodeSelector"] == {"accelerator": "ascend"}


def test_cards_per_node_from_the_config_sizes_the_workers():
    cfg = parse_config(_ascend_data(image=IMAGE, cards_per_node=4))
    svc = rayservice_manifest(cfg, cluster_spec(cfg))
    group = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert group["maxReplicas"] == 2  # 8 replicas over 4-card nodes
    assert group["rayStartParams"]["resources"] == '"{\\"NPU\\": 4}"'


def test_a_config_with_a_cluster_section_still_renders_a_serve_config_that_round_trips(
        cluster_config):
    cfg = load_config(cluster_config)
    served = serve_config(cfg)
    ServeDeploySchema.model_validate(served)
    assert config_from_serve_yaml(render_yaml(cfg)) == cfg


def test_flags_override_the_config_rayservice(capsys, cluster_config):
    code, out, _ = _render(capsys, "--config", str(cluster_config), "--kuberay",
                           "--image", "registry.local:5000/emb:2",
                           "--node-selector", "pool=embeddings",
                           "--node-selector", "accelerator=huawei-Ascend910B")
    assert code == 0
    head, worker = _pods(rayservice_of(out))
    assert {c["image"] for c in head["containers"] + worker["containers"]} == {
        "registry.local:5000/emb:2"}
    # Merged key by key over the config's selector; the flag wins on a shared key.
    assert worker["nodeSelector"] == {"accelerator": "huawei-Ascend910B",
                                      "node.kubernetes.io/instance-type": "a2",
                                      "pool": "embeddings"}


def test_flags_override_the_config_launcher(capsys, cluster_config):
    code, out, _ = _render(capsys, "--config", str(cluster_config), "--ray-cluster",
                           "--head-address", "head.lab.internal",
                           "--worker-address", "10.1.0.2", "--worker-address", "10.1.0.3")
    assert code == 0
    provider = yaml.safe_load(out)["provider"]
    assert provider["head_ip"] == "head.lab.internal"
    assert provider["worker_ips"] == ["10.1.0.2", "10.1.0.3"]  # replaces the config's list


def test_flags_alone_give_a_complete_launcher(capsys):
    code, out, _ = _render(capsys, "--config", str(ASCEND_910B_CONFIG), "--ray-cluster",
                           "--image", IMAGE, "--head-address", "10.0.0.1",
                           "--worker-address", "10.0.0.2")
    assert code == 0
    launcher = yaml.safe_load(out)
    assert (launcher["docker"]["image"], launcher["provider"]["head_ip"],
            launcher["provider"]["worker_ips"]) == (IMAGE, "10.0.0.1", ["10.0.0.2"])
    assert "EXAMPLE" not in out and "example.com" not in out


@pytest.mark.parametrize("kind, needs", [
    ("--kuberay", ["--image", "cluster.image"]),
    ("--ray-cluster", ["--image", "cluster.image", "--head-address", "cluster.head_address",
                       "--worker-address", "cluster.worker_addresses"]),
])
def test_missing_values_are_refused_not_made_up(capsys, kind, needs):
    code, out, err = _render(capsys, "--config", str(ASCEND_910B_CONFIG), kind)
    assert code == 2 and out == ""
    for word in needs + ["--example"]:
        assert word in err
    with pytest.raises(ConfigError, match="cluster.image"):
        render_rayservice(ASCEND)


def test_launcher_without_head_only_names_what_is_missing(capsys):
    code, out, err = _render(capsys, "--config", str(ASCEND_910B_CONFIG), "--ray-cluster",
                             "--image", IMAGE, "--worker-address", "10.0.0.2")
    assert code == 2 and out == ""
    assert "--head-address" in err and "cluster.image" not in err


@pytest.mark.parametrize("kind, example", [("--kuberay", "rayservice-910b.yaml"),
                                           ("--ray-cluster", "ray-cluster-910b.yaml")])
def test_example_flag_renders_the_checked_in_examples(capsys, kind, example):
    code, out, _ = _render(capsys, "--config", str(ASCEND_910B_CONFIG), kind, "--example")
    assert code == 0
    assert out == (EXAMPLES_DIR / example).read_text()
    assert out.splitlines()[1].startswith("# EXAMPLE (rendered with --example)")
    assert EXAMPLE_IMAGE in out


def test_example_fills_only_the_gaps(cluster_config):
    cfg = load_config(cluster_config)
    assert cluster_spec(cfg, example=True).placeholders == ()
    spec = cluster_spec(ASCEND, image=IMAGE, example=True)
    assert spec.image == IMAGE and spec.placeholders == ("head_ip", "worker_ips")
    text = render_rayservice(ASCEND, spec)
    assert "EXAMPLE" not in text  # the RayService carries none of the placeholders


@pytest.mark.parametrize("cluster, field, value", [
    ({"node_selector": {"Bad Key!": "x"}}, "node_selector", "'Bad Key!'"),
    ({"node_selector": {"Example.COM/pool": "a"}}, "node_selector", "'Example.COM/pool'"),
    ({"node_selector": {"pool": "not a value"}}, "node_selector", "'not a value'"),
    ({"head_node_selector": {"-pool": "a"}}, "head_node_selector", "'-pool'"),
    ({"image": "Registry/Embedfleet Ascend"}, "image", "'Registry/Embedfleet Ascend'"),
    ({"head_address": ""}, "head_address", "''"),
    ({"head_address": "http://10.0.0.1:6379"}, "head_address", "'http://10.0.0.1:6379'"),
    ({"worker_addresses": ["10.0.0.2", "10.0.0 .3"]}, "worker_addresses[1]", "'10.0.0 .3'"),
    ({"worker_addresses": ["10.0.0.2", "10.0.0.2"]}, "worker_addresses", "'10.0.0.2'"),
    ({"head_address": "10.0.0.2", "worker_addresses": ["10.0.0.2"]}, "head_address",
     "'10.0.0.2'"),
    ({"name": "Emb_Prod"}, "cluster.name", "'Emb_Prod'"),
    ({"cards_per_node": 0}, "cluster.cards_per_node", "0"),
    ({"imagee": IMAGE}, "cluster.imagee", IMAGE),
])
def test_invalid_cluster_section_fails_at_load_naming_field_and_value(tmp_path, cluster, field,
                                                                      value):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_ascend_data(**cluster)))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "cluster" in message and field in message and value in message, message


@pytest.mark.parametrize("argv, flag, value", [
    (["--kuberay", "--node-selector", "Bad Key!=x"], "--node-selector", "'Bad Key!'"),
    (["--kuberay", "--node-selector", "pool"], "--node-selector", "'pool'"),
    (["--kuberay", "--image", "Not An Image"], "--image", "'Not An Image'"),
    (["--ray-cluster", "--head-address", ""], "--head-address", "''"),
    (["--ray-cluster", "--worker-address", "10.0.0.2:22"], "--worker-address", "'10.0.0.2:22'"),
])
def test_bad_flag_values_exit_2_naming_flag_and_value(capsys, argv, flag, value):
    code, out, err = _render(capsys, "--config", str(ASCEND_910B_CONFIG), *argv)
    assert code == 2 and out == ""
    assert f"argument {flag}: " in err and value in err


@pytest.mark.parametrize("argv, flag", [
    (["--kuberay", "--image", IMAGE, "--head-address", "10.0.0.1"], "--head-address"),
    (["--kuberay", "--image", IMAGE, "--worker-address", "10.0.0.2"], "--worker-address"),
    (["--ray-cluster", "--example", "--node-selector", "a=b"], "--node-selector"),
    (["--image", IMAGE], "--image"),
    (["--example"], "--example"),
])
def test_flags_for_another_manifest_are_refused_not_ignored(capsys, argv, flag):
    code, out, err = _render(capsys, "--config", str(ASCEND_910B_CONFIG), *argv)
    assert code == 2 and out == ""
    assert f"{flag} applies to" in err


def test_flags_merged_with_the_config_are_checked_together(capsys, cluster_config):
    code, out, err = _render(capsys, "--config", str(cluster_config), "--ray-cluster",
                             "--head-address", "10.0.0.2")  # a worker of the config
    assert code == 2 and out == ""
    assert "'10.0.0.2' is also in worker_addresses" in err


def test_launcher_refuses_fewer_cards_than_min_replicas():
    cfg = _with_replicas(12, 16)
    spec = cluster_spec(cfg, image=IMAGE, head_address="10.0.0.1", worker_addresses=["10.0.0.2"])
    with pytest.raises(ConfigError, match="1 worker address.* 8 cards .* 12"):
        cluster_launcher_config(cfg, spec)


def test_rayservice_refuses_a_name_kuberay_would_reject():
    cfg = parse_config({**_ascend_data(image=IMAGE), "app_name": "Embed_Fleet"})
    with pytest.raises(ConfigError, match="cluster.name"):
        rayservice_manifest(cfg, cluster_spec(cfg))


def test_image_requirements_name_the_pinned_cann():
    """The image's CANN is the pinned vllm-ascend's (deployments/engine/ascend_release.py), not the
    seed's 8.1.RC1, in the rendered headers and the examples' README alike."""
    from embedfleet.deployments.engine import ascend_release

    assert CANN_VERSION == ascend_release.CANN_VERSION
    wanted = f"CANN {CANN_VERSION} (what vllm-ascend {ascend_release.VLLM_ASCEND_VERSION} requires)"
    for name in ("ray-cluster-910b.yaml", "rayservice-910b.yaml", "README.md"):
        text = " ".join((EXAMPLES_DIR / name).read_text().replace("# ", "").split())
        assert wanted in text and "8.1.RC1" not in text, name


@pytest.mark.parametrize("name", ["local-cpu.yaml", "ascend-910b-qwen3-embedding-8b.yaml",
                                  "cuda-qwen3-embedding-0.6b.yaml"])
def test_no_deployment_can_fill_its_actor_past_health_checks(name):
    # A replica holding Ray's async-actor concurrency (1000) in requests answers no health check
    # and is killed with all it holds; every deployment keeps headroom below it, even a model
    # whose budget + max_waiting is larger (the queue then waits in Serve's handle).
    from ray._common.ray_constants import DEFAULT_MAX_CONCURRENCY_ASYNC

    from embedfleet.deployments.config.ray_options import CONTROL_CALL_HEADROOM

    from embedfleet.deployments.config.schema import config_to_data

    cfg = load_config(CONFIG_DIR / name)
    data = config_to_data(cfg)
    data["models"][0].setdefault("admission", {})["max_waiting"] = 5000
    big = parse_config(data, "test")
    for c in (cfg, big):
        for dep in serve_config(c)["applications"][0]["deployments"]:
            ongoing = dep.get("max_ongoing_requests", 5)  # Serve's default
            assert ongoing <= DEFAULT_MAX_CONCURRENCY_ASYNC - CONTROL_CALL_HEADROOM, (
                name, dep["name"], ongoing)
