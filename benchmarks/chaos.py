"""Chaos and soak: mixed load against a running embedfleet cluster while faults are injected.

    python -m embedfleet.benchmarks.chaos --duration 120 --concurrency 4 --fault-every 30 \\
        --faults kill-replica,kill-engine,stop-prometheus
    python -m embedfleet.benchmarks.chaos --soak --config my-cluster.yaml   # 11 min, a fault every minute
    python -m embedfleet.benchmarks.chaos --duration 30 --rps 20 --faults none  # load only
    python -m embedfleet.benchmarks.chaos --soak --duration 3600 --faults-until 660 \
        --config my-cluster.yaml   # 60 min: each fault once, then 49 quiet minutes for memory

Faults, taken in turn on the schedule (the first after one period, as warm-up); --soak takes them
all in this order, one a minute:
  kill-replica     ray.kill() a random Serve replica actor of an `engine-*` deployment
  kill-engine      SIGKILL the vLLM EngineCore child process of a random engine replica
  stop-prometheus  stop the Prometheus `embedfleet up` runs; restart it --prometheus-down s later
                   (with --config: give the config the cluster was started with)
  kill-proxy       ray.kill() the Serve proxy (ProxyActor); Serve's controller starts a new one
  pause-engine     SIGSTOP a random engine's EngineCore and its workers (a hung card, not a dead
                   one) for --pause s, by default the health-stall bound plus four check
                   periods (Serve replaces a replica after three failed checks); then SIGCONT
  kill-governor    ray.kill() the MemoryGovernor replica; Serve replaces it
  flood-kill       send one model a burst of one-text requests beyond its admission bounds
                   (--burst; else 1.5x the bound read from --config; else 256), then ray.kill()
                   one of its replicas under it; the burst's outcomes are reported on the fault,
                   apart from the load's
  kill-controller  ray.kill() the ServeController with restart allowed; Ray restarts it
  kill-registry    ray.kill() the FleetRegistry replica; Serve replaces it
  kill-router      ray.kill() a Router replica (the HTTP ingress deployment); Serve replaces it,
                   and HAProxy replays on another Router the requests it held

Load: seeded mixed requests (one text, a batch of texts, token ids) across the served models.
The run is bounded by --duration and --max-requests, and only ever targets a loopback URL: this
tool kills processes, so it must never be pointed at somebody else's cluster by a typo.
Report: requests sent / succeeded / failed by status, p50/p99 latency, and for the whole run,
before the first fault and in each fault's window (to the next fault), what clients saw by model:
requests, successes, status counts, client timeouts, whether every failure was a 503/429 with
Retry-After, p50/p99; RSS of each Serve process at start and end, by role and by pid; each
process tree's RSS every --memory-every s, its growth in its first and last 10 minutes and its
slope over the run's last half (chaos_memory; exit 1 past --max-slope MB/h). JSON under
benchmarks/results/ (figures of record under "summary") plus a readable summary. Not part of
`make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import time
import urllib.parse
from pathlib import Path
from typing import Any

# Options, orchestration and the command live here; what each fault hits in chaos_targets, the
# faults in chaos_faults, the load in chaos_load, the per-model arithmetic in chaos_stats and the
# report in chaos_report. Their names are re-exported because tests import them from here.
from .chaos_faults import (Cluster, fault_schedule, flood_plan, inject_faults, parse_faults)
from .chaos_load import (MAX_CONCURRENCY, MAX_DURATION_S, MAX_REQUESTS, MAX_RPS, Tally, classify,
                         mixed_request, run_load)
from .chaos_memory import MAX_SLOPE_MB_PER_H, MEMORY_EVERY_S, sample_memory
from .chaos_report import build_report, summary
from .chaos_stats import Sample, by_model, memory_growth, percentile, stats
from .chaos_targets import (ENGINE_REPLICA, FAULT_KINDS, MAX_BURST, TARGETS, burst_size,
                            engine_core_pids, engine_replicas, find_targets, is_actor_process,
                            model_of, pause_seconds, process_role, serve_actors)

__all__ = [
    # this module: options, orchestration, the command
    "RESULTS", "DEFAULTS", "SOAK", "MAX_PAUSE_S", "check_loopback", "resolve_options",
    "default_pause", "run", "drive", "main",
    # embedfleet.benchmarks.chaos_targets
    "FAULT_KINDS", "TARGETS", "ENGINE_REPLICA", "MAX_BURST", "find_targets", "engine_replicas",
    "serve_actors", "model_of", "process_role", "is_actor_process", "engine_core_pids",
    "burst_size", "pause_seconds",
    # embedfleet.benchmarks.chaos_faults
    "parse_faults", "fault_schedule", "flood_plan", "Cluster",
    # embedfleet.benchmarks.chaos_load
    "MAX_DURATION_S", "MAX_REQUESTS", "MAX_CONCURRENCY", "MAX_RPS", "classify", "mixed_request",
    "Tally",
    # embedfleet.benchmarks.chaos_stats and chaos_report
    "Sample", "percentile", "stats", "by_model", "memory_growth", "build_report", "summary",
]

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULTS = {"duration": 60.0, "concurrency": 4, "rps": None, "fault_every": 30.0,
            "faults": "none", "max_requests": 10_000, "connection_retries": 0,
            "memory_every": MEMORY_EVERY_S, "faults_until": None, "max_slope": MAX_SLOPE_MB_PER_H}
SOAK = {"duration": 660.0, "concurrency": 4, "fault_every": 60.0,
        "faults": ",".join(FAULT_KINDS), "max_requests": 200_000}
# An engine left stopped for long is a fault of its own making; past this, Serve's health
# checks have long since replaced the replica, so a longer pause shows nothing new.
MAX_PAUSE_S = 600
MAX_CONNECTION_RETRIES = 5
MAX_MEMORY_EVERY_S = 600


# -- options (unit-tested in tests/test_chaos_tool.py) -------------------------------------------
def check_loopback(url: str) -> str:
    """The URL, if its host is loopback (127.0.0.0/8, ::1, localhost); else ValueError."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{url!r}: only http(s) URLs")
    host = parts.hostname or ""
    if host != "localhost":
        try:
            if not ipaddress.ip_address(host).is_loopback:
                raise ValueError
        except ValueError:
            raise ValueError(f"{url!r}: host {host or '(none)'!r} is not loopback; this tool "
                             "only targets a cluster on this machine") from None
    return url.rstrip("/")


def resolve_options(args: argparse.Namespace) -> dict[str, Any]:
    """Flags over the --soak preset over the defaults, then the hard bounds."""
    base = {**DEFAULTS, **(SOAK if args.soak else {})}
    opts = {k: v if getattr(args, k, None) is None else getattr(args, k) for k, v in base.items()}
    if args.rps is not None:
        opts["concurrency"] = None  # open loop instead of a fixed number of workers
    opts["faults"] = list(parse_faults(opts["faults"]))
    opts["url"] = check_loopback(args.url)
    checks = [(0 < opts["duration"] <= MAX_DURATION_S, f"--duration in (0, {MAX_DURATION_S}]"),
              (0 < opts["max_requests"] <= MAX_REQUESTS, f"--max-requests in 1..{MAX_REQUESTS}"),
              (opts["rps"] is None or 0 < opts["rps"] <= MAX_RPS, f"--rps in (0, {MAX_RPS}]"),
              (opts["concurrency"] is None or 0 < opts["concurrency"] <= MAX_CONCURRENCY,
               f"--concurrency in 1..{MAX_CONCURRENCY}"),
              (not opts["faults"] or opts["fault_every"] > 0, "--fault-every > 0"),
              (args.pause is None or 0 < args.pause <= MAX_PAUSE_S,
               f"--pause in (0, {MAX_PAUSE_S}]"),
              (args.burst is None or 0 < args.burst <= MAX_BURST, f"--burst in 1..{MAX_BURST}"),
              (0 <= opts["connection_retries"] <= MAX_CONNECTION_RETRIES,
               f"--connection-retries in 0..{MAX_CONNECTION_RETRIES}"),
              (0 < opts["memory_every"] <= MAX_MEMORY_EVERY_S,
               f"--memory-every in (0, {MAX_MEMORY_EVERY_S}]"),
              (opts["faults_until"] is None or opts["faults_until"] > 0, "--faults-until > 0"),
              (opts["max_slope"] > 0, "--max-slope > 0")]
    for ok, rule in checks:
        if not ok:
            raise ValueError(f"out of bounds: {rule}")
    opts.update(seed=args.seed, prometheus_down_s=args.prometheus_down, config=args.config,
                request_timeout_s=args.request_timeout, soak=args.soak, pause_s=args.pause,
                burst=args.burst)
    return opts


def default_pause(cfg: Any) -> float:
    """--pause when not given: past the health-stall bound of the cluster's config, or of the
    schema's defaults without --config (the Serve options are rendered from the same fields)."""
    from ..deployments.config.schema import EmbedfleetConfig

    def field(name: str) -> float:
        return EmbedfleetConfig.model_fields[name].default if cfg is None else getattr(cfg, name)

    return pause_seconds(field("health_stall_timeout_s"), field("health_check_period_s"))


def client_timeout(cfg: Any) -> float:
    """--request-timeout when not given: a client that waits as long as the cluster may take to
    answer (a call held for a replacement engine is bounded by the larger of the router's
    request_timeout_s and the model's cold_start_hold_s), so a timeout is the cluster's fault."""
    if cfg is None:
        return 60.0
    return 30.0 + max(max(cfg.router.request_timeout_s, m.replicas.cold_start_hold_s)
                      for m in cfg.models)


# -- the run ----------------------------------------------------------------------------------
async def run(opts: dict[str, Any]) -> dict[str, Any]:
    cfg = _load_config(opts["config"])
    if opts.get("pause_s") is None:
        opts["pause_s"] = default_pause(cfg)
    if opts.get("request_timeout_s") is None:
        opts["request_timeout_s"] = client_timeout(cfg)
    models = opts.get("models") or _served_models(opts["url"])
    cluster = Cluster(opts["config"], random.Random(opts["seed"] + 1), cfg)
    trace: list = []

    async def load_and_sample(tally, deadline):
        # RSS of every Serve process tree through the run, for the slope over its last half.
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_memory(
            lambda: asyncio.to_thread(_safe_memory, cluster), tally.t0, opts["memory_every"],
            trace, stop))
        try:
            await run_load(opts, models, tally, deadline)
        finally:
            stop.set()
            await asyncio.gather(sampler, return_exceptions=True)

    tally, log, wall = await drive(opts, cluster, load_and_sample)
    trace.append((round(wall, 1), await asyncio.to_thread(_safe_memory, cluster)))
    return build_report({**opts, "models": models}, tally, wall, log, trace[0][1], trace[-1][1],
                        trace=trace)


async def drive(opts: dict[str, Any], cluster: Any, load) -> tuple[Tally, list[dict], float]:
    """Run ``load(tally, deadline)`` with the fault schedule beside it; on the way out (also on
    an error or Ctrl-C) wait for a fault being injected, then undo what is still undone:
    restart a stopped Prometheus, resume a paused engine."""
    t0 = time.monotonic()
    tally, log, restarts = Tally(t0=t0), [], []
    done = asyncio.Event()
    fault_task = asyncio.create_task(inject_faults(opts, cluster, t0, log, restarts, done))
    try:
        await load(tally, t0 + opts["duration"])
    finally:
        # Not cancel(): a fault being injected finishes, so its state is known; a pending
        # Prometheus restart or engine resume happens now rather than after its delay.
        done.set()
        await asyncio.gather(fault_task, return_exceptions=True)
        await asyncio.gather(*restarts, return_exceptions=True)
        if cluster.prometheus_stopped:  # a restart failed, or never got scheduled
            log.append({"t_s": round(time.monotonic() - t0, 1), "kind": "restart-prometheus",
                        "ok": True, "target": cluster.start_prometheus()})
        if cluster.paused:  # a resume failed: a stopped engine must not outlive the run
            log.append({"t_s": round(time.monotonic() - t0, 1), "kind": "resume-engine",
                        "ok": True, "target": cluster.resume_engine(list(cluster.paused))})
    return tally, log, time.monotonic() - t0


def _load_config(path: str | None) -> Any:
    if path is None:
        return None
    from ..deployments.config.schema import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as err:
        raise SystemExit(str(err)) from None


def _served_models(url: str) -> list[str]:
    import httpx

    try:
        return [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
        raise SystemExit(f"cannot list models at {url}/v1/models ({err!r}); is the cluster up "
                         "(`embedfleet up`)?") from None


def _safe_memory(cluster: Cluster) -> list[dict[str, Any]]:
    try:
        return cluster.memory()
    except Exception as exc:  # no Ray access: the load report still stands
        print(f"memory not measured: {type(exc).__name__}: {exc}")
        return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="loopback only")
    p.add_argument("--duration", type=float,
                   help=f"seconds of load (default {DEFAULTS['duration']:g})")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--concurrency", type=int, help="closed loop: workers (default 4)")
    rate.add_argument("--rps", type=float, help="open loop: requests per second")
    p.add_argument("--max-requests", type=int, help="stop after this many requests")
    p.add_argument("--fault-every", type=float, help="seconds between faults")
    p.add_argument("--faults", help=f"comma list of {', '.join(FAULT_KINDS)}, or none")
    p.add_argument("--soak", action="store_true",
                   help="10 min of mixed load, all faults, one a minute (flags still override)")
    p.add_argument("--models", help="comma list (default: every model in /v1/models)")
    p.add_argument("--config", help="the cluster's embedfleet config: its app, admission bounds, "
                   "health-check timing and Prometheus")
    p.add_argument("--prometheus-down", type=float, default=20.0,
                   help="seconds Prometheus stays stopped")
    p.add_argument("--pause", type=float, help="seconds pause-engine keeps an engine stopped "
                   "(default: health_stall_timeout_s + 4 x health_check_period_s)")
    p.add_argument("--burst", type=int, help="requests in flood-kill's burst "
                   f"(default: 1.5x the admission bound from --config, max {MAX_BURST})")
    p.add_argument("--request-timeout", type=float,
                   help="client timeout in seconds (default: the longest a request may take by "
                   "the --config, max(request_timeout_s, cold_start_hold_s) + 30, else 60)")
    p.add_argument("--connection-retries", type=int,
                   help="resend a request whose connection broke (refused, reset, cut) up to N "
                   "times, 0.5 s doubling, as the OpenAI SDK does by default with N=2 (default 0: "
                   "every broken connection is a failure); the steady load only, not flood-kill's "
                   "burst; the report counts the retried")
    p.add_argument("--memory-every", type=float, help="seconds between RSS samples of every "
                   f"Serve process tree (default {DEFAULTS['memory_every']:g})")
    p.add_argument("--faults-until", type=float, help="no fault at or after this second: a "
                   "quiet tail whose processes live through the run's last half, where the "
                   "memory slope is taken (default: faults to the end)")
    p.add_argument("--max-slope", type=float, help="exit 1 when a process tree's RSS grows "
                   "faster than this over the run's last half, MB per hour (default "
                   f"{MAX_SLOPE_MB_PER_H:g}: 0.72 GB over 72 hours)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="report path (default benchmarks/results/chaos-<time>.json)")
    p.add_argument("--min-success-ratio", type=float,
                   help="exit 1 when the success ratio falls below this")
    args = p.parse_args(argv)
    try:
        opts = resolve_options(args)
    except ValueError as err:
        p.error(str(err))
    if args.models:
        opts["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    report = asyncio.run(run(opts))
    out = Path(args.out) if args.out else RESULTS / f"chaos-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(summary(report))
    print(f"report written to {out}")
    ratio = report["requests"]["success_ratio"]
    failed = False
    if args.min_success_ratio is not None and (ratio or 0) < args.min_success_ratio:
        print(f"FAIL: success ratio {ratio} < {args.min_success_ratio}")
        failed = True
    if report["memory"]["verdict"]["flat"] is False:
        print(f"FAIL: memory grows past {opts['max_slope']} MB/h over the last half: "
              + ", ".join(report["memory"]["verdict"]["over_bound"]))
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
