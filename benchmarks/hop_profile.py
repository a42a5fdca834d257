"""Where one online request's time goes, hop by hop (issue 13): one short text, one in flight.

    python -m embedfleet.benchmarks.hop_profile [--url URL] [--model M] [--requests 300]
        [--repeats 5] [--out FILE]

Against a running cluster (``embedfleet up``), four ways in, alternated in every repeat:

* ``http``: ``POST /v1/embeddings`` (client -> ingress -> Router -> replica -> vLLM; the
  ingress is HAProxy, or Serve's Python proxy with ``router.http_ingress: serve_proxy``);
* ``router-handle``: ``Router.embed_batch`` through its Serve handle from this Ray driver, on the
  interactive lane (driver -> Router -> replica -> vLLM): no HTTP, no ingress;
* ``replica-handle``: the model's engine deployment's ``embed`` through its Serve handle, by
  value over Serve's gRPC transport as the Router sends a small call (driver -> replica -> vLLM):
  no router either;
* ``replica-object-store``: the same call through Ray core's actor call and object store (the
  Router's ``handle_transport: object_store``), so one run also prices the transport.

Each hop's cost is the difference of two medians (p50 of each run, median over the repeats):
``http - router-handle`` is HTTP and the ingress hop, ``router-handle - replica-handle`` the
router's own work and its handle call; ``replica-handle`` is the replica and its engine (compare
the bench's bare ``AsyncLLM`` on the router-overhead workload). Wall time is measured by the
client, not read from Ray's histograms: Ray 2.60 exports a histogram's ``_sum`` from bucket
midpoints (``open_telemetry_metric_recorder``), too coarse for milliseconds.

CPU is measured per process group of the cluster (``ray_cluster_scope``: HAProxy or Serve
proxy, Router, the replica with its engine core and workers, Ray's daemons, Prometheus) and this
client, as CPU-milliseconds per request: on two cores, CPU spent anywhere is latency everywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

VARIANTS = ("http", "router-handle", "replica-handle", "replica-object-store")
# (hop, the variant that includes it, the variant that does not); None: nothing below it measured
HOPS = (("HTTP + ingress", "http", "router-handle"),
        ("Router (its work + its handle call)", "router-handle", "replica-handle"),
        ("replica + vLLM engine", "replica-handle", None))
# Not a hop of the online path: what the object store costs instead of gRPC on the same call.
TRANSPORT = ("object store instead of gRPC (replica's handle)", "replica-object-store",
             "replica-handle")
CLIENT = "this client"


@dataclass
class Run:
    variant: str
    latencies_ms: list[float]
    # None: the cluster's processes were not found, so CPU is unmeasured (never read as 0)
    cpu_ms_per_request: dict[str, float] | None = None

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.latencies_ms)

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.latencies_ms)


def order(repeats: int) -> list[str]:
    """Every variant once per repeat, rotated each repeat so none always runs first."""
    return [VARIANTS[(i + r) % len(VARIANTS)] for r in range(repeats) for i in range(len(VARIANTS))]


def summarize(runs: Sequence[Run]) -> dict[str, Any]:
    """Medians over the repeats, per variant, and each hop as a difference of medians."""
    by: dict[str, list[Run]] = {v: [r for r in runs if r.variant == v] for v in VARIANTS}
    missing = [v for v, rs in by.items() if not rs]
    if missing:
        raise ValueError(f"no run of {missing}: every variant needs at least one repeat")
    p50 = {v: statistics.median(r.p50_ms for r in rs) for v, rs in by.items()}
    groups = sorted({g for r in runs for g in r.cpu_ms_per_request or ()})
    cpu: dict[str, dict[str, float] | None] = {}
    for v, rs in by.items():
        measured = [r.cpu_ms_per_request for r in rs if r.cpu_ms_per_request is not None]
        cpu[v] = {g: round(statistics.median(c.get(g, 0.0) for c in measured), 3)
                  for g in groups} if measured else None
    hops = [{"hop": name, "p50_ms": round(p50[with_] - (p50[without] if without else 0.0), 2),
             "from": f"{with_} - {without}" if without else with_}
            for name, with_, without in HOPS]
    name, slow, fast = TRANSPORT
    cpu_delta = (None if cpu[slow] is None or cpu[fast] is None
                 else round(sum(cpu[slow].values()) - sum(cpu[fast].values()), 2))
    return {
        "variants": {v: {"p50_ms": round(p50[v], 2),
                         "p50_ms_per_repeat": [round(r.p50_ms, 2) for r in by[v]],
                         "mean_ms": round(statistics.median(r.mean_ms for r in by[v]), 2),
                         "cpu_ms_per_request": cpu[v],
                         "cpu_ms_per_request_total": (None if cpu[v] is None
                                                      else round(sum(cpu[v].values()), 2))}
                     for v in VARIANTS},
        "hops": hops,
        "transport": {"what": name, "from": f"{slow} - {fast}",
                      "p50_ms": round(p50[slow] - p50[fast], 2),
                      "cpu_ms_per_request": cpu_delta},
    }


def table(summary: Mapping[str, Any]) -> str:
    variants = summary["variants"]
    http_cpu = variants["http"]["cpu_ms_per_request"] or {}
    groups = sorted({g for v in variants.values() for g in v["cpu_ms_per_request"] or ()},
                    key=lambda g: -http_cpu.get(g, 0.0))
    lines = ["| way in | p50 ms | mean ms | CPU-ms / request | " + " | ".join(groups) + " |",
             "|---|---|---|---|" + "---|" * len(groups)]
    for name, v in variants.items():
        cpu = v["cpu_ms_per_request"]
        cells = ["unmeasured"] * (1 + len(groups)) if cpu is None else (
            [f"{v['cpu_ms_per_request_total']:.1f}"] + [f"{cpu.get(g, 0.0):.1f}" for g in groups])
        lines.append(f"| {name} | {v['p50_ms']:.1f} | {v['mean_ms']:.1f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "| hop | p50 ms | from |", "|---|---|---|"]
    lines += [f"| {h['hop']} | {h['p50_ms']:.1f} | {h['from']} |" for h in summary["hops"]]
    t = summary["transport"]
    cpu = "unmeasured" if t["cpu_ms_per_request"] is None else f"{t['cpu_ms_per_request']:+.1f}"
    lines += ["", f"{t['what']}: {t['p50_ms']:+.1f} ms p50, {cpu} CPU-ms / request "
              f"({t['from']})"]
    return "\n".join(lines)


def cpu_per_request(usage: Mapping[str, Any], requests: int) -> dict[str, float] | None:
    """``CpuMeter.stop()``'s scopes as CPU-ms per request per group (the client as one group);
    None when no process of the cluster was found (as ``report.cpu_section`` treats it)."""
    cluster = usage["scopes"]["cluster"]
    if cluster["processes"] == 0:
        return None
    out = {g: 1000.0 * s / requests for g, s in cluster["by_group"].items()}
    out[CLIENT] = 1000.0 * usage["scopes"]["client"]["cpu_s"] / requests
    return out


class Ways:
    """The four ways into the cluster, each a callable embedding one text."""

    def __init__(self, url: str, model: str, app: str) -> None:
        import httpx
        from ray import serve

        from ..deployments.config.ray_options import engine_deployment_name

        self.model = model
        self._http = httpx.Client(base_url=url, timeout=60)
        # the app's ingress: its Router, or (router.ingress: engine) the engine replicas
        # themselves, whose embed_batch then runs the pipeline in the replica
        self._router = serve.get_app_handle(app)
        self._object_store = serve.get_deployment_handle(engine_deployment_name(model), app)
        self._replica = self._object_store.options(_by_reference=False)

    def call(self, variant: str) -> Callable[[str], int]:
        from ..deployments.common.contracts import BatchCall, EmbedCall

        def http(text: str) -> int:
            r = self._http.post("/v1/embeddings", json={"model": self.model, "input": [text]})
            r.raise_for_status()
            return len(r.json()["data"][0]["embedding"])

        def router(text: str) -> int:
            res = self._router.embed_batch.remote(
                BatchCall(self.model, [text], None, "interactive")).result()
            return res.vectors.shape[1]

        def replica(handle: Any) -> Callable[[str], int]:
            def embed(text: str) -> int:
                call = EmbedCall([text], f"hop-{uuid.uuid4().hex[:12]}", self.model)
                return handle.embed.remote(call).result().vectors.shape[1]
            return embed

        return {"http": http, "router-handle": router, "replica-handle": replica(self._replica),
                "replica-object-store": replica(self._object_store)}[variant]

    def close(self) -> None:
        self._http.close()


def run_one(ways: Ways, variant: str, batch: list[str], meter_scopes: Mapping[str, Any]) -> Run:
    from .process_cpu import CpuMeter

    call = ways.call(variant)
    dims = {call(t) for t in batch[:5]}  # warm the path (connections, handles) before measuring
    meter = CpuMeter(meter_scopes).start()
    lat: list[float] = []
    for t in batch:
        t0 = time.perf_counter()
        dims.add(call(t))
        lat.append(1000.0 * (time.perf_counter() - t0))
    usage = meter.stop()
    if len(dims) != 1:
        raise RuntimeError(f"{variant}: vectors of several sizes came back: {sorted(dims)}")
    return Run(variant, lat, cpu_per_request(usage, len(batch)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m embedfleet.benchmarks.hop_profile",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="all-minilm-l6-v2")
    p.add_argument("--requests", type=int, default=300, help="per run (default 300)")
    p.add_argument("--repeats", type=int, default=5, help="runs of each way in (default 5)")
    p.add_argument("--app", default="embedfleet", help="the Serve application (default: "
                   "embedfleet)")
    p.add_argument("--out", type=Path, help="write the JSON report here")
    args = p.parse_args(argv)
    if args.requests < 10 or args.repeats < 1:
        p.error("--requests must be at least 10 and --repeats at least 1")

    import ray

    from .process_cpu import OwnProcess
    from .ray_cluster_scope import RayCluster
    from .workloads import short_queries
    from ..cluster.prometheus_server import PID_NAME
    from ..deployments.common.settings import settings

    s = settings()
    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    scopes = {"cluster": RayCluster(urlparse(args.url).port or 80,
                                    s.state_dir / "prometheus" / PID_NAME),
              "client": OwnProcess(os.getpid(), CLIENT)}
    ways = Ways(args.url, args.model, args.app)
    runs: list[Run] = []
    try:
        for k, variant in enumerate(order(args.repeats)):
            run = run_one(ways, variant, short_queries(args.requests, seed=k), scopes)
            runs.append(run)
            cpu = ("unmeasured" if run.cpu_ms_per_request is None
                   else f"{sum(run.cpu_ms_per_request.values()):6.1f} ms/request")
            print(f"{variant:15s} p50 {run.p50_ms:6.1f} ms  mean {run.mean_ms:6.1f} ms  CPU {cpu}",
                  file=sys.stderr)
    finally:
        ways.close()
    summary = summarize(runs)
    command = "python -m embedfleet.benchmarks.hop_profile " + " ".join(argv or sys.argv[1:])
    report = {"command": command,
              "url": args.url, "model": args.model, "requests_per_run": args.requests,
              "repeats": args.repeats, "cluster": scopes["cluster"].describe(), **summary,
              "runs": [{"variant": r.variant, "p50_ms": round(r.p50_ms, 2),
                        "mean_ms": round(r.mean_ms, 2),
                        "cpu_ms_per_request": None if r.cpu_ms_per_request is None else
                        {g: round(v, 3) for g, v in r.cpu_ms_per_request.items()}}
                       for r in runs]}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    print(table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
