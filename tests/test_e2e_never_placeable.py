"""A model that can never get a card says so at once, on a real cluster (issue 39 item 2).

The issue's cluster: one card; mini-a (min 1, max 1) holds it for good; mini-b (min 0, max 1)
can never get it. A request to mini-b must be answered 503 + Retry-After within 1 s, naming
mini-a, not held as a cold start that never comes.

Not beside the session cluster: its cards are shared by the session's models, some of them
above their minimum (minilm-autoscale, minilm-zero), so there a card may always come back and a
call is rightly held; and a second app's replicas on those cards are holders the first app does
not know, which the registry also treats as "may come back". So this test starts a throwaway
Ray head of its own (as tests/test_gcs_restart.py does): one logical NPU card, every port free
and its own, its own temp dir and token, started with `ray start` (no autoscaling config: Ray's
read-only autoscaler, which cannot add a node — what `embedfleet up` starts). A driver deploys
the real app (deployments/app.py build: Router, registry, governor, real vLLM MiniLM engines)
with Serve's proxy on a free port. Cleanup deletes the app, then kills only this head's
processes (and their children, the engine's), by pid.

Tiered with ``engine`` (a heavyweight process tree without the session cluster). Its head and
app start in the background: ``test_the_one_card_head_is_under_way`` starts them at the start
of the tier, and the refusal test runs at the tier's end (``tier_end``), so the minutes of
`ray start`, Serve's start and mini-a's engine start overlap the other engine tests instead of
holding them up; the head is killed as soon as that test ends. In `make test` the start runs
while the session cluster starts on the same machine, the case it guards: Ray's state API given
no address reads the machine's latest `ray start` cluster (the session's), and a registry that
read it found none of its own replicas (mini-a answered 503, or mini-b held 120 s); the registry
names its own GCS (deployments/fleet/placement.py own_cluster_actors).
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import psutil
import pytest
import requests
import yaml

from embedfleet.deployments.config.ray_options import HEAD_ENV_VARS
from embedfleet.deployments.config.schema import DEFAULT_CONFIG_PATH
from tests.test_gcs_restart import ThrowawayHead, free_ports

pytestmark = [pytest.mark.engine]

RAY = str(Path(sys.executable).with_name("ray"))
APP = "never-e2e"

DEPLOY = """
import sys, ray
from ray import serve
from embedfleet.deployments.app import build
from embedfleet.deployments.config.ray_options import RUNTIME_ENV_VARS
from embedfleet.deployments.config.schema import load_config
cfg = load_config(sys.argv[2])
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False,
         runtime_env={"env_vars": RUNTIME_ENV_VARS})
serve.start(http_options={"host": "127.0.0.1", "port": cfg.router.port})
serve.run(build(cfg), name=cfg.app_name, route_prefix="/", blocking=False)
print("deployed")
"""

SHUTDOWN = """
import sys, ray
from ray import serve
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
serve.shutdown()
print("shut down")
"""


class OneCardHead(ThrowawayHead):
    """tests/test_gcs_restart.py's throwaway head without GCS fault tolerance, with one logical
    NPU card and its dashboard (the registry reads Ray's actor table through its state API)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        for no_redis in ("RAY_REDIS_ADDRESS", "RAY_external_storage_namespace"):
            self.env.pop(no_redis)
        self.env.update(HEAD_ENV_VARS)
        # Serve kills a proxy that misses 3 readiness checks of 5 s each (Ray's default); beside
        # the session cluster's engine starts on two cores, this head's proxy took longer and
        # was killed before serve.start returned. A starved-machine allowance for this test.
        self.env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] = "60"
        self.http_port, self.no_prometheus_port = free_ports(2)
        # Its token as a file too, in a home of its own: Ray's state API (list_actors, which the
        # registry calls inside a replica) took the token from ~/.ray/auth_token, the session
        # cluster's on this machine, and every look at the actor table failed with
        # InvalidAuthToken (seen in the registry's log), so the registry never saw the cards.
        home = root / "home"
        (home / ".ray").mkdir(parents=True)
        (home / ".ray" / "auth_token").write_text(self.env["RAY_AUTH_TOKEN"])
        self.env.update(HOME=str(home), RAY_AUTH_TOKEN_PATH=str(home / ".ray" / "auth_token"))

    def start(self) -> None:
        cmd = [RAY, "start", "--head", f"--temp-dir={self.root / 'ray'}",
               "--node-ip-address=127.0.0.1", f"--port={self.gcs_port}",
               f"--node-manager-port={self.nm_port}", f"--object-manager-port={self.om_port}",
               f"--ray-client-server-port={self.client_port}",
               f"--dashboard-agent-listen-port={self.agent_port}",
               f"--dashboard-agent-grpc-port={self.agent_grpc}",
               f"--metrics-export-port={self.metrics_port}",
               f"--runtime-env-agent-port={self.rt_env_port}",
               "--include-dashboard=true", "--dashboard-host=127.0.0.1",
               f"--dashboard-port={self.dashboard_port}",
               f"--min-worker-port={self.workers[0]}", f"--max-worker-port={self.workers[1]}",
               "--num-cpus=2", f"--resources={json.dumps({'NPU': 1})}",
               "--disable-usage-stats"]
        self.ray_start(cmd)

    def run(self, script: str, *args: str, timeout: float = 300) -> str:
        done = subprocess.run([sys.executable, "-c", script, self.address, *args],
                              env=self.env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    def processes(self) -> list[psutil.Process]:
        """The head's processes and their children (a replica's vLLM engine core, whose
        command line names no temp dir); ``kill`` kills them all."""
        out = {}
        for p in super().processes():
            out[p.pid] = p
            try:
                out.update({c.pid: c for c in p.children(recursive=True)})
            except psutil.NoSuchProcess:
                continue
        return list(out.values())


def issue_config(head: OneCardHead, tmp: Path) -> Path:
    """The bundled MiniLM twice: mini-a at min 1 (max 1), mini-b scale-to-zero (max 1)."""
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    (model,) = data["models"]
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    a.update(name="mini-a", replicas={"min_replicas": 1, "max_replicas": 1})
    b.update(name="mini-b", replicas={"min_replicas": 0, "max_replicas": 1})
    data.update(app_name=APP, cards=1, models=[a, b],
                router={"host": "127.0.0.1", "port": head.http_port, "ingress": "router",
                        "http_ingress": "serve_proxy"},
                # nothing listens there: the governor holds its limits (not the session's series)
                governor={"prometheus_url": f"http://127.0.0.1:{head.no_prometheus_port}"})
    path = tmp / "never.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class BackgroundApp:
    """The one-card head and its app, started on a thread of their own: ``url`` waits for the
    deploy and returns the app's base URL (or raises what the start raised); ``stop`` deletes the
    app and kills the head: on a thread when the refusal test ends, or at the session's end when
    that test did not run."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="efnever-", dir="/tmp"))  # short: Ray's sockets
        self.head = OneCardHead(self.root)
        self.started: Future[str] = Future()
        self._stopping: threading.Thread | None = None
        threading.Thread(target=self._start, name="never-placeable-head", daemon=True).start()

    def _start(self) -> None:
        try:
            self.head.start()
            # serve.run returns once the app runs: mini-a's engine loaded (minutes when starved)
            self.head.run(DEPLOY, str(issue_config(self.head, self.root)), timeout=1200)
            self.started.set_result(f"http://127.0.0.1:{self.head.http_port}")
        except BaseException as exc:  # noqa: BLE001 - handed to the test that waits on it
            self.started.set_exception(exc)

    def url(self, timeout_s: float = 1500) -> str:
        return self.started.result(timeout=timeout_s)

    def stop_in_background(self) -> None:
        """``stop`` on a thread: the tests after this one need nothing of the head."""
        self._stopping = threading.Thread(target=self.stop, name="never-placeable-stop")
        self._stopping.start()

    def join(self) -> None:
        if self._stopping is None:
            self.stop()
        else:
            self._stopping.join()

    def stop(self) -> None:
        try:
            self.started.exception(timeout=1500)  # let a start under way end before the kill
        except TimeoutError:
            pass
        try:
            self.head.run(SHUTDOWN, timeout=120)  # replicas stop their engines
        except (AssertionError, subprocess.TimeoutExpired):
            pass
        self.head.kill()
        # the serve logs (registry, routers) outlive the head, for a failure to be read
        logs = self.root / "ray" / "session_latest" / "logs" / "serve"
        if logs.is_dir():
            shutil.copytree(logs, Path(tempfile.gettempdir()) / "efnever-last-serve-logs",
                            dirs_exist_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def one_card_app_started():
    app = BackgroundApp()
    yield app
    app.join()  # the refusal test's stop, or this one when that test did not run


@pytest.fixture
def one_card_app(one_card_app_started):
    try:
        yield one_card_app_started.url()
    finally:
        one_card_app_started.stop_in_background()


@pytest.mark.tier_start
def test_the_one_card_head_is_under_way(one_card_app_started):
    assert one_card_app_started.root.is_dir()
    assert not one_card_app_started.started.done() or one_card_app_started.url(timeout_s=0)


def wait_for(check, timeout_s: float, what: str, every: float = 2.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (out := check()) is not None:
            return out
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def embed(url: str, model: str, timeout: float = 60) -> requests.Response:
    return requests.post(f"{url}/v1/embeddings", json={"model": model, "input": "hello"},
                         timeout=timeout)


@pytest.mark.tier_end  # its app started in the background at the tier's start
def test_a_model_whose_card_never_comes_back_is_refused_within_a_second(one_card_app):
    url = one_card_app

    def ready():
        try:
            r = requests.get(f"{url}/ready", timeout=10)
        except requests.RequestException:
            return None
        return r if r.status_code == 200 else None
    wait_for(ready, 900, "mini-a's engine to serve (/ready 200)", every=5)
    assert embed(url, "mini-a").status_code == 200  # the holder serves

    # The registry says "never" once the card has been held for good for its grace; until
    # then a call to mini-b is held as a cold start and refused when the reason appears.
    def refused():
        r = embed(url, "mini-b", timeout=120)
        assert r.status_code == 503, r.text  # never a 200 (no card) nor a 500
        return r if "can never get a card" in r.json()["error"]["message"] else None
    wait_for(refused, 120, "mini-b refused as never placeable", every=1)

    for _ in range(3):
        t0 = time.monotonic()
        r = embed(url, "mini-b")
        took = time.monotonic() - t0
        assert r.status_code == 503 and took <= 1.0, (r.status_code, took, r.text)
        assert int(r.headers["Retry-After"]) >= 1
        err = r.json()["error"]
        assert err["type"] == "service_unavailable" and err["code"] == "no_ready_replica"
        assert "model 'mini-b' can never get a card" in err["message"]
        assert "'mini-a'" in err["message"], err  # the holder, by name

    # /ready stays 200 (mini-b may be at zero) and says why mini-b cannot come up
    body = requests.get(f"{url}/ready", timeout=10).json()
    assert "can never get a card" in body["waiting"]["mini-b"], body
    assert embed(url, "mini-a").status_code == 200  # the holder still serves
