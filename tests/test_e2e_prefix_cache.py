"""Prefix caching per model type, the run-time canary, the fault injector and the fingerprint."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import requests

from embedfleet.deployments.common.fingerprint import model_digest
from tests.conftest import FAULT_ARM_FILE, FAULTY_QWEN3, MINILM, TINY_QWEN3, run_cli
from tests.support.live_cluster import COLD_START_BOUND_S, ray_script

pytestmark = pytest.mark.cluster

# A shared instruction of 300+ tokens (the MiniLM tokenizer the tiny Qwen3 uses).
PREFIX = ("Instruct: Given a question about contract law, retrieve the statute sections and court "
          "decisions that answer it, preferring binding authority from the same jurisdiction. ") * 12


def embed(cluster, model, texts):
    resp = requests.post(f"{cluster}/v1/embeddings", json={"model": model, "input": texts,
                                                           "encoding_format": "float"}, timeout=120)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    vecs = np.array([d["embedding"] for d in body["data"]], np.float32)
    return vecs, body["usage"], resp.headers


def model_info(cluster, name):
    data = requests.get(f"{cluster}/v1/models", timeout=10).json()["data"]
    return next(m for m in data if m["id"] == name)


def cos(a, b):
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module", autouse=True)
def disarm_the_fault_injector_afterwards():
    """This file arms the cache-hit fault; the next replica of the faulty model (the reliability
    tests replace it) would fail its canary again and swap engines, a second cold start (~50 s
    here) that a call of those tests waited out at the gate."""
    yield
    FAULT_ARM_FILE.unlink(missing_ok=True)


def test_minilm_reports_prefix_cache_off_with_reason(cluster):
    pc = model_info(cluster, MINILM)["prefix_cache"]
    assert pc["enabled"] is False and pc["state"] == "off"
    assert "bidirectional" in pc["reason"] and pc["last_canary"] is None


def test_tiny_qwen3_serves_with_prefix_cache_on_and_canary_passes(cluster):
    pc = model_info(cluster, TINY_QWEN3)["prefix_cache"]
    assert pc["enabled"] is True and pc["state"] == "on", pc
    canary = pc["last_canary"]
    assert canary["passed"] and canary["conclusive"], canary
    assert canary["min_cosine"] >= 0.99999 and canary["cached_tokens"] > 0
    assert canary["prefix_tokens"] > 3 * 32  # spans several KV blocks


def test_shared_prefix_hits_cache_and_vectors_are_identical(cluster, minilm_tokenizer):
    assert len(minilm_tokenizer(PREFIX)["input_ids"]) >= 300
    nonce = f"[{time.time_ns()}] "  # nothing cached yet for this prefix
    a, b = nonce + PREFIX + "Query: is consideration required?", nonce + PREFIX + "Query: what?"
    cold, usage_cold, _ = embed(cluster, TINY_QWEN3, [a])
    assert usage_cold["prompt_tokens_details"]["cached_tokens"] == 0
    _, usage_b, _ = embed(cluster, TINY_QWEN3, [b])
    warm, usage_warm, headers = embed(cluster, TINY_QWEN3, [a])
    # vLLM reports the cached tokens per request: the shared prefix was reused
    assert usage_b["prompt_tokens_details"]["cached_tokens"] >= 300
    assert usage_warm["prompt_tokens_details"]["cached_tokens"] >= 300
    assert cos(cold[0], warm[0]) >= 0.99999
    assert headers["x-embedfleet-prefix-cache"] == "on"


def test_every_response_carries_the_fingerprint(cluster, minilm_path, tiny_qwen3_dir):
    _, _, h = embed(cluster, MINILM, ["fingerprint"])
    assert h["x-embedfleet-model-digest"] == model_digest(minilm_path)
    assert h["x-embedfleet-dtype"] == "float32"
    assert h["x-embedfleet-engine"].startswith("vllm 0.")
    assert h["x-embedfleet-platform"] == "cpu"
    assert h["x-embedfleet-prefix-cache"] == "off"
    _, _, hq = embed(cluster, TINY_QWEN3, ["fingerprint"])
    assert hq["x-embedfleet-model-digest"] == model_digest(tiny_qwen3_dir)
    assert hq["x-embedfleet-model-digest"] != h["x-embedfleet-model-digest"]


def test_failing_canary_switches_prefix_cache_off_without_losing_requests(cluster):
    texts = [PREFIX + f"Query: question number {i}?" for i in range(4)]
    truth, _, _ = embed(cluster, TINY_QWEN3, texts)  # same weights, healthy engine
    before = model_info(cluster, FAULTY_QWEN3)["prefix_cache"]
    assert before["state"] == "on" and before["last_canary"]["passed"], before

    statuses: list[int | str] = []
    stop = threading.Event()
    # A call that meets the swap waits at the replica's gate for the new engine, up to the
    # model's bound (cold_start_hold_s): the client waits longer than that, and a call that
    # gets no answer is recorded, not lost with the thread.
    from embedfleet.deployments.config.schema import load_config
    from tests.conftest import E2E_CONFIG

    cfg = load_config(E2E_CONFIG)
    (model_cfg,) = [m for m in cfg.models if m.name == FAULTY_QWEN3]
    bound_s = max(cfg.router.request_timeout_s, model_cfg.replicas.cold_start_hold_s)

    def load():
        i = 0
        while not stop.is_set():
            t_call = time.monotonic()
            try:
                r = requests.post(f"{cluster}/v1/embeddings", json={
                    "model": FAULTY_QWEN3, "input": [texts[i % 4]]}, timeout=bound_s + 30)
                # anything but a 200 is kept with what it said, so a failure names its path
                statuses.append(200 if r.status_code == 200 else
                                f"{r.status_code} after {time.monotonic() - t_call:.0f}s: "
                                f"{r.text[:300]}")
            except requests.RequestException as exc:
                statuses.append(f"no answer: {exc!r}")
            i += 1

    worker = threading.Thread(target=load, daemon=True)
    FAULT_ARM_FILE.touch()  # from now on, cache hits on this engine give wrong vectors
    worker.start()
    try:
        t0 = time.monotonic()
        detected = None
        # "off" needs the replacement engine started
        while time.monotonic() - t0 < COLD_START_BOUND_S:
            pc = model_info(cluster, FAULTY_QWEN3)["prefix_cache"]
            if detected is None and pc["state"] != "on":
                detected = time.monotonic() - t0
            if pc["state"] == "off":
                break
            time.sleep(1)
    finally:
        stop.set()
        worker.join(timeout=bound_s + 60)
    assert not worker.is_alive(), "a call during the swap got no answer within its bound"
    assert detected is not None and detected <= 10 + 10, f"canary reacted after {detected}s"
    assert pc["state"] == "off" and pc["enabled"] is False, pc
    assert "canary" in pc["reason"] and pc["last_canary"]["passed"] is False
    assert pc["last_canary"]["min_cosine"] < 0.99
    assert statuses and set(statuses) == {200}, statuses  # nothing failed during the switch
    after, usage, headers = embed(cluster, FAULTY_QWEN3, texts)
    again, usage2, _ = embed(cluster, FAULTY_QWEN3, texts)
    assert usage2["prompt_tokens_details"]["cached_tokens"] == 0  # caching is really off
    assert headers["x-embedfleet-prefix-cache"] == "off"
    assert min(cos(x, y) for x, y in zip(again, truth)) >= 0.99999
    assert min(cos(x, y) for x, y in zip(after, truth)) >= 0.99999
    # ...and it stays off: the healthy model is untouched
    assert model_info(cluster, TINY_QWEN3)["prefix_cache"]["state"] == "on"


REGISTRY_PID = """
import ray
from ray.util.state import list_actors
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
print(" ".join(str(a.pid) for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
               if a.class_name == "ServeReplica:embedfleet:FleetRegistry"))
"""


def test_override_survives_a_registry_restart(cluster):
    # Runs after the canary switched the faulty model off. The registry keeps the override in
    # Ray's GCS-backed KV, so the replica Serve starts in place of a killed one still has it.
    import signal

    from tests.support.live_cluster import wait_for

    def registry_pid() -> str:
        return ray_script(REGISTRY_PID)

    old = registry_pid()
    assert old and " " not in old, old
    os.kill(int(old), signal.SIGKILL)
    # every=3: each poll is a Ray driver (~2 CPU-s) on the two cores the new replica needs
    new = wait_for(lambda: (p := registry_pid()) and p != old and p, 300, "a new registry",
                   every=3)
    shown = wait_for(lambda: (r := run_cli("prefix-cache", "--app", "embedfleet",
                                           check=False)).returncode == 0 and r.stdout,
                     300, "the restarted registry to answer", every=3)
    assert f"{FAULTY_QWEN3}: OFF by override" in shown and "canary" in shown, (new, shown)
    # ...and the fleet still obeys it: the faulty model's replica reports caching off.
    pc = wait_for(lambda: model_info(cluster, FAULTY_QWEN3)["replicas"]["cards"] and
                  model_info(cluster, FAULTY_QWEN3)["prefix_cache"], 60, "the faulty model listed")
    assert pc["state"] == "off", pc


DRIVERS_RUN_AS = """
import sys
import ray
from ray.util.state import list_jobs
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
print(sum(1 for j in list_jobs(limit=10000) if (j.entrypoint or "").endswith(sys.argv[1])))
"""


def test_prefix_cache_override_is_shown_and_can_be_cleared(cluster):
    # Runs after the canary switched the faulty model off.
    shown = run_cli("prefix-cache", "--app", "embedfleet").stdout
    assert f"{FAULTY_QWEN3}: OFF by override" in shown and "canary" in shown, shown
    assert f"{TINY_QWEN3}: no override" in shown
    out = run_cli("prefix-cache", "--app", "embedfleet", "--clear", FAULTY_QWEN3).stdout
    assert f"{FAULTY_QWEN3}: override cleared" in out, out
    assert f"{FAULTY_QWEN3}: no override" in run_cli("prefix-cache", "--app", "embedfleet").stdout
    again = run_cli("prefix-cache", "--app", "embedfleet", "--clear", FAULTY_QWEN3).stdout
    assert "no override to clear" in again
    # Each run was one Ray driver. A driver per step (the status read, then the clear) left
    # Serve's handle threads to re-connect between them by Ray's auto-init, which streamed every
    # cluster log to the terminal and made the second ray.init raise: CI's `--clear` exited 1.
    drivers = ray_script(DRIVERS_RUN_AS, f"prefix-cache --app embedfleet --clear {FAULTY_QWEN3}")
    assert drivers == "2", drivers
    bad = run_cli("prefix-cache", "--app", "embedfleet", "--clear", "nope", check=False)
    assert bad.returncode == 2 and "not a model of application embedfleet" in bad.stderr


def test_canary_failure_is_in_prometheus(cluster):
    # Runs after the switch: Ray exports the counter, Prometheus (started by `embedfleet up`)
    # scrapes it through Ray's service discovery.
    deadline = time.monotonic() + 120
    value = None
    while time.monotonic() < deadline:
        r = requests.get("http://127.0.0.1:9090/api/v1/query", params={
            "query": f'sum(ray_embedfleet_canary_failures_total{{model="{FAULTY_QWEN3}"}})'},
            timeout=10).json()
        if r["data"]["result"]:
            value = float(r["data"]["result"][0]["value"][1])
            if value >= 1:
                break
        time.sleep(5)
    assert value is not None and value >= 1
