"""Record how Ray exports user metrics, for ``testdata/ray-scrape.txt``.

``embedfleet.deployments.common.metrics.MetricSpec.exported`` encodes Ray's naming (``ray_`` prefix, ``_total`` on
counters, histogram suffixes); the tests check it against a scrape recorded by this probe. Re-run
it after upgrading Ray and commit the new file:

    python -m tests.support.ray_probe > tests/support/testdata/ray-scrape.txt

It starts a private one-CPU Ray instance (own temp dir, no dashboard, no Serve), records one metric of each
kind from an actor, scrapes the node's metrics agent and prints the ``embedfleet_probe`` lines.
Takes ~15-30 s: Ray's agent publishes user metrics every ~10 s.
"""

from __future__ import annotations

import shutil
import socket
import sys
import tempfile
import time
import urllib.request

# (name, kind): counters with and without the `_total` suffix, since Ray treats them alike.
PROBES: tuple[tuple[str, str], ...] = (
    ("embedfleet_probe_requests_total", "counter"),
    ("embedfleet_probe_inputs", "counter"),
    ("embedfleet_probe_ready", "gauge"),
    ("embedfleet_probe_latency_seconds", "histogram"),
)
TIMEOUT_S = 90.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _record() -> None:
    from ray.util import metrics

    for name, kind in PROBES:
        if kind == "counter":
            metrics.Counter(name, "probe", tag_keys=("model",)).inc(3, tags={"model": "m"})
        elif kind == "gauge":
            metrics.Gauge(name, "probe", tag_keys=("model",)).set(1, tags={"model": "m"})
        else:
            metrics.Histogram(name, "probe", boundaries=[0.1, 1.0],
                              tag_keys=("model",)).observe(0.5, tags={"model": "m"})


def scrape_probe_metrics() -> str:
    """Start Ray, record the probes, return the scraped ``embedfleet_probe`` lines."""
    import ray

    port = _free_port()
    # A private instance in its own temp dir: address="local" never joins the shared cluster
    # another process runs, and the temp dir keeps /tmp/ray/session_latest pointing at it.
    temp_dir = tempfile.mkdtemp(prefix="efprobe-")
    ray.init(address="local", num_cpus=1, include_dashboard=False, _metrics_export_port=port,
             _temp_dir=temp_dir, log_to_driver=False)
    try:
        @ray.remote(num_cpus=0)
        class Recorder:
            def run(self) -> None:
                _record()

        recorder = Recorder.remote()
        ray.get(recorder.run.remote())
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
                lines = [ln for ln in resp.read().decode().splitlines()
                         if "embedfleet_probe" in ln]
            if all(any(name in ln for ln in lines) for name, _ in PROBES):
                return "\n".join(lines) + "\n"
            if time.monotonic() > deadline:
                raise TimeoutError(f"probe metrics not exported within {TIMEOUT_S}s")
            time.sleep(2)
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.stdout.write(scrape_probe_metrics())
