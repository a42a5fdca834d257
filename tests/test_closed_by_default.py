"""Closed by default: `up` binds loopback and says so; a bind beyond it without API keys is
refused by render, deploy and up, unless ``router.allow_unauthenticated`` says it is meant.

In-process CLI calls with the cluster parts replaced (no Ray is started): what reaches
``local.rest_deploy`` is the Serve config that would be deployed.
"""

from __future__ import annotations

import pytest
import yaml

from embedfleet.cluster import cli, local
from embedfleet.cluster.render import render_yaml
from embedfleet.deployments.config.schema import (DEFAULT_CONFIG_PATH, ConfigError, RouterConfig,
                                           load_config)
from embedfleet.deployments.config.router import is_loopback, open_bind_refusal

KEYS = "/etc/embedfleet/keys"  # not read by render or deploy: the config says keys are required


def config_file(tmp_path, **router) -> str:
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    data["router"] = {**data.get("router", {}), **router}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture
def fake_cluster(monkeypatch):
    """`up`/`deploy` with no Ray: the Serve configs that would be deployed, in order."""
    deployed: list[dict] = []
    monkeypatch.setattr(local, "ensure_token_auth", lambda: None)
    monkeypatch.setattr(local, "start_head", lambda *a, **k: "127.0.0.1:6379")
    monkeypatch.setattr(cli, "start_monitoring", lambda cfg: None)
    monkeypatch.setattr(local, "rest_deploy", lambda dashboard, cfg: deployed.append(cfg))
    monkeypatch.setattr(local, "wait_ready", lambda *a, **k: {"models": {}})
    monkeypatch.setattr(cli, "_wait_settled", lambda *a, **k: None)
    # `deploy` reads the running cluster's cards with a real ray.init("auto"): in `make test` the
    # session cluster is up by then, and the driver it left connected in pytest's process made
    # every later in-process ray.init raise "called ray.init twice" (7 cluster tests in CI)
    monkeypatch.setattr(cli, "running_cluster_cards", lambda resource: None)
    return deployed


def test_the_default_bind_is_loopback():
    assert RouterConfig().host == "127.0.0.1"
    assert load_config(DEFAULT_CONFIG_PATH).router.host == "127.0.0.1"
    assert yaml.safe_load(render_yaml(load_config(DEFAULT_CONFIG_PATH)))["http_options"][
        "host"] == "127.0.0.1"


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("api.internal", False)])
def test_loopback_is_what_stays_on_the_machine(host, loopback):
    assert is_loopback(host) is loopback
    assert (open_bind_refusal(RouterConfig(), host) is None) is loopback


@pytest.mark.parametrize("router", [{"api_keys_file": KEYS}, {"api_keys_env": "MY_KEYS"},
                                    {"allow_unauthenticated": True}])
def test_a_wide_bind_needs_keys_or_the_explicit_flag(router):
    assert RouterConfig(host="0.0.0.0", **router).host == "0.0.0.0"
    with pytest.raises(ValueError, match="binds beyond loopback with no API keys"):
        RouterConfig(host="0.0.0.0")


def test_render_refuses_an_open_wide_bind(tmp_path, capsys):
    code = cli.main(["render", "--config", config_file(tmp_path, host="0.0.0.0")])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert "router.host='0.0.0.0' binds beyond loopback" in err
    assert "allow_unauthenticated" in err and "api_keys_file" in err
    assert cli.main(["render", "--config", config_file(tmp_path, host="0.0.0.0",
                                                      allow_unauthenticated=True)]) == 0


def test_up_prints_its_loopback_bind_and_deploys_it(tmp_path, capsys, fake_cluster):
    assert cli.main(["up", "--detach", "--config", config_file(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "HTTP ingress binds 127.0.0.1:8000 (loopback only: this machine); no API keys" in out
    (deployed,) = fake_cluster
    assert deployed["http_options"]["host"] == "127.0.0.1"


def test_up_host_flag_widens_the_bind_only_with_keys(tmp_path, capsys, fake_cluster):
    code = cli.main(["up", "--detach", "--host", "0.0.0.0", "--config", config_file(tmp_path)])
    assert code == 2 and fake_cluster == []  # refused before anything starts
    assert "--host 0.0.0.0: router.host='0.0.0.0' binds beyond loopback" in \
        capsys.readouterr().err
    keys = tmp_path / "api-keys"
    keys.write_text("sk-up-test-0123456789\n")
    assert cli.main(["up", "--detach", "--host", "0.0.0.0",
                     "--config", config_file(tmp_path, api_keys_file=str(keys))]) == 0
    assert "HTTP ingress binds 0.0.0.0:8000 (every interface); API keys required" in \
        capsys.readouterr().out
    (deployed,) = fake_cluster
    assert deployed["http_options"]["host"] == "0.0.0.0"
    assert deployed["applications"][0]["args"]["config"]["router"]["host"] == "0.0.0.0"


def test_a_hand_edited_serve_config_that_opens_the_bind_is_refused(tmp_path, capsys,
                                                                   fake_cluster):
    """The bind Serve gets is http_options.host, whatever the embedded config says."""
    data = yaml.safe_load(render_yaml(load_config(DEFAULT_CONFIG_PATH)))
    data["http_options"]["host"] = "0.0.0.0"
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(data))
    for argv in (["up", "--detach"], ["deploy", "--address", "127.0.0.1"]):
        assert cli.main([*argv, "--serve-config", str(path)]) == 2
        assert "binds beyond loopback with no API keys" in capsys.readouterr().err
    assert fake_cluster == []


def test_deploy_refuses_an_open_wide_bind(tmp_path, capsys, fake_cluster):
    with pytest.raises(ConfigError):  # the same rule at load, for code that loads configs
        load_config(config_file(tmp_path, host="10.0.0.5"))
    assert cli.main(["deploy", "--address", "127.0.0.1",
                     "--config", config_file(tmp_path, host="10.0.0.5")]) == 2
    assert fake_cluster == []
    assert cli.main(["deploy", "--address", "127.0.0.1", "--config",
                     config_file(tmp_path, host="10.0.0.5", allow_unauthenticated=True)]) == 0
    assert "NO API keys (router.allow_unauthenticated)" in capsys.readouterr().out


def test_up_refuses_keys_it_cannot_load_before_starting_anything(tmp_path, capsys, fake_cluster,
                                                                 monkeypatch):
    """`up` runs every node here: keys named but missing or empty here would stop every ingress
    replica, so `up` says so at once instead of waiting for /ready."""
    keys = tmp_path / "api-keys"
    keys.write_text("# nothing yet\n")
    for router in ({"api_keys_file": str(keys)}, {"api_keys_file": str(tmp_path / "absent")},
                   {"api_keys_env": "EMBEDFLEET_TEST_UP_KEYS"}):
        monkeypatch.delenv("EMBEDFLEET_TEST_UP_KEYS", raising=False)
        assert cli.main(["up", "--detach", "--config", config_file(tmp_path, **router)]) == 2
        assert "every ingress replica would refuse to start" in capsys.readouterr().err
    assert fake_cluster == []
    keys.write_text("sk-up-test-0123456789\n")
    assert cli.main(["up", "--detach", "--config",
                     config_file(tmp_path, api_keys_file=str(keys))]) == 0


def test_the_local_head_keeps_its_ip_as_its_node_name(monkeypatch):
    """Serve reads a node's name as its address, and its HAProxy reaches a Router replica on
    its own node at localhost only when the two agree: a named head sent it to the machine's
    address, where a Router bound to loopback (the default) cannot be reached."""
    started: list[list[str]] = []
    monkeypatch.setattr(local, "ray_running", lambda address: False)
    monkeypatch.setattr(local, "_ray_start", lambda cmd, env: started.append(cmd))
    monkeypatch.setattr(local, "node_ip", lambda: "192.0.2.2")
    local.start_head(4, nodes=2)
    head, worker = started
    assert not any(a.startswith("--node-name") for a in head)
    assert "--node-name=local-node-1" in worker
    assert local.local_node_name(0) == "192.0.2.2"


def test_one_log_monitor_for_the_machine(monkeypatch):
    """The local nodes share the head's session log folder: only the head runs Ray's log
    monitor (a second read every file again, and sent each line to drivers twice)."""
    started: list[list[str]] = []
    monkeypatch.setattr(local, "ray_running", lambda address: False)
    monkeypatch.setattr(local, "_ray_start", lambda cmd, env: started.append(cmd))
    monkeypatch.setattr(local, "node_ip", lambda: "192.0.2.2")
    local.start_head(6, nodes=3)
    head, *workers = started
    assert not any(a.startswith("--include-log-monitor") for a in head)
    assert len(workers) == 2
    assert all("--include-log-monitor=False" in w for w in workers)
