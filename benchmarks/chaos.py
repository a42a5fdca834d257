"""Chaos and soak: mixed load against a running embedfleet cluster while faults are injected.

    python -m benchmarks.chaos --duration 120 --concurrency 4 --fault-every 30 \\
        --faults kill-replica,kill-engine,stop-prometheus
    python -m benchmarks.chaos --soak --config my-cluster.yaml   # 10 min, a fault every minute
    python -m benchmarks.chaos --duration 30 --rps 20 --faults none  # load only

Faults, taken in turn on the schedule (the first after one period, as warm-up):
  kill-replica     ray.kill() a random Serve replica actor of an `engine-*` deployment
  kill-engine      SIGKILL the vLLM EngineCore child process of a random engine replica
  stop-prometheus  stop the Prometheus `embedfleet up` runs; restart it --prometheus-down s later
                   (with --config: give the config the cluster was started with)

Load: seeded mixed requests (one text, a batch of texts, token ids) across the served models.
The run is bounded by --duration and --max-requests, and only ever targets a loopback URL: this
tool kills processes, so it must never be pointed at somebody else's cluster by a typo.
Report: requests sent / succeeded / failed by status, p50/p99 latency, faults injected, and RSS of
the proxy, router and replica process trees at start and end; JSON under benchmarks/results/ plus
a readable summary. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import os
import random
import re
import signal
import time
import urllib.parse
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from benchmarks.throughput import WORDS

RESULTS = Path(__file__).resolve().parent / "results"
FAULT_KINDS = ("kill-replica", "kill-engine", "stop-prometheus")
# Hard ceilings: a mistyped flag must not turn a test into an unbounded flood.
MAX_DURATION_S = 3600
MAX_REQUESTS = 1_000_000
MAX_CONCURRENCY = 256
MAX_RPS = 1000
DEFAULTS = {"duration": 60.0, "concurrency": 4, "rps": None, "fault_every": 30.0,
            "faults": "none", "max_requests": 10_000}
SOAK = {"duration": 600.0, "concurrency": 4, "fault_every": 60.0,
        "faults": ",".join(FAULT_KINDS), "max_requests": 200_000}
ENGINE_REPLICA = re.compile(r"ServeReplica:[^:]+:(engine-.+)")


# -- pure parts (unit-tested in tests/test_chaos_tool.py) ----------------------------------------
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


def parse_faults(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip() and k.strip() != "none")
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown:
        raise ValueError(f"unknown fault(s) {unknown}; choose from {', '.join(FAULT_KINDS)}")
    return kinds


def fault_schedule(duration_s: float, every_s: float,
                   faults: Iterable[str]) -> list[tuple[float, str]]:
    """(seconds from start, kind): one fault per period, kinds in turn, none at t=0 (warm-up)
    nor at or after the end (its effect could not be observed)."""
    kinds = list(faults)
    if not kinds or every_s <= 0:
        return []
    n = math.ceil(duration_s / every_s) - 1
    return [(round(every_s * (i + 1), 3), kinds[i % len(kinds)]) for i in range(max(n, 0))]


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    data = sorted(values)
    if not data:
        return None
    rank = max(1, math.ceil(q / 100 * len(data)))
    return data[min(rank, len(data)) - 1]


def classify(status: int, body: Any, n_inputs: int) -> str:
    """'ok' only for a 200 holding one vector per input; otherwise the status (or bad_200)."""
    if status == 200:
        data = body.get("data") if isinstance(body, dict) else None
        return "ok" if isinstance(data, list) and len(data) == n_inputs else "bad_200"
    return str(status)


def mixed_request(rng: random.Random, models: list[str]) -> tuple[dict[str, Any], int]:
    """A request body and its input count: one text, a batch of 2-16 texts, or token ids."""
    model = rng.choice(models)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))

    shape = rng.random()
    if shape < 0.5:
        return {"model": model, "input": text()}, 1
    if shape < 0.85:
        n = rng.randint(2, 16)
        return {"model": model, "input": [text() for _ in range(n)]}, n
    # ids inside every served vocabulary (MiniLM's 30522 is the smallest here)
    return {"model": model, "input": [rng.randint(1000, 29999) for _ in range(rng.randint(4, 64))],
            "encoding_format": "base64"}, 1


@dataclass
class Tally:
    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)
    ok_latencies: list[float] = field(default_factory=list)
    all_latencies: list[float] = field(default_factory=list)

    def record(self, outcome: str, latency_s: float) -> None:
        self.outcomes[outcome] += 1
        self.all_latencies.append(latency_s)
        if outcome == "ok":
            self.ok_latencies.append(latency_s)


def engine_replicas(actors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Alive Serve replica actors of `engine-*` deployments."""
    return [a for a in actors if a.get("state") == "ALIVE"
            and ENGINE_REPLICA.fullmatch(a.get("class_name") or "")]


def process_role(class_name: str) -> str | None:
    """The memory-report role of a Serve actor: its deployment, or 'proxy'; None otherwise."""
    if class_name == "ProxyActor":
        return "proxy"
    if class_name.startswith("ServeReplica:"):
        return class_name.split(":", 2)[2]
    return None


def engine_core_pids(children: Iterable[tuple[int, str, list[str]]]) -> list[int]:
    """Of a replica's child processes (pid, name, cmdline), the vLLM engine core(s); vLLM sets the
    process title to VLLM::EngineCore."""
    return [pid for pid, name, cmd in children
            if "EngineCore" in name or (cmd and "EngineCore" in cmd[0])]


def memory_growth(start: dict[str, dict], end: dict[str, dict]) -> dict[str, float]:
    return {role: round(end[role]["rss_mb"] - start[role]["rss_mb"], 1)
            for role in sorted(set(start) & set(end))}


def build_report(opts: dict[str, Any], tally: Tally, wall_s: float, faults: list[dict],
                 mem_start: dict, mem_end: dict) -> dict[str, Any]:
    succeeded = tally.outcomes.get("ok", 0)
    failed = {k: v for k, v in sorted(tally.outcomes.items()) if k != "ok"}

    def ms(values: list[float], q: float) -> float | None:
        v = percentile(values, q)
        return None if v is None else round(1000 * v, 1)

    return {
        "tool": "benchmarks.chaos", "options": opts, "wall_s": round(wall_s, 1),
        "requests": {"sent": tally.sent, "succeeded": succeeded,
                     "failed": sum(failed.values()), "failed_by_status": failed,
                     "success_ratio": round(succeeded / tally.sent, 5) if tally.sent else None,
                     "achieved_rps": round(tally.sent / wall_s, 1) if wall_s > 0 else None},
        "latency_ms": {"ok_p50": ms(tally.ok_latencies, 50), "ok_p99": ms(tally.ok_latencies, 99),
                       "all_p50": ms(tally.all_latencies, 50),
                       "all_p99": ms(tally.all_latencies, 99),
                       "all_max": ms(tally.all_latencies, 100)},
        "faults": faults,
        "memory": {"start": mem_start, "end": mem_end,
                   "growth_mb": memory_growth(mem_start, mem_end)},
    }


def summary(report: dict[str, Any]) -> str:
    r, lat, mem = report["requests"], report["latency_ms"], report["memory"]
    ratio = "n/a" if r["success_ratio"] is None else f"{100 * r['success_ratio']:.2f}%"
    lines = [f"chaos run: {report['wall_s']}s, {r['sent']} requests ({r['achieved_rps']}/s)",
             f"  succeeded {r['succeeded']}  failed {r['failed']} {r['failed_by_status'] or ''}"
             f"  success {ratio}",
             f"  latency ok p50 {lat['ok_p50']} ms  p99 {lat['ok_p99']} ms  "
             f"(all requests p99 {lat['all_p99']} ms, max {lat['all_max']} ms)",
             f"  faults injected: {len(report['faults'])}"]
    lines += [f"    t={f['t_s']:>6}s {f['kind']:<16} {'ok ' if f['ok'] else 'ERR'} "
              f"{f.get('target') or f.get('error', '')}" for f in report["faults"]]
    lines.append("  memory (RSS of process trees, MB): role  xprocesses  start -> end  (growth)")
    for role, growth in mem["growth_mb"].items():
        a, b = mem["start"][role], mem["end"][role]
        lines.append(f"    {role:<28} x{a['processes']}->{b['processes']} {a['rss_mb']:>8} -> "
                     f"{b['rss_mb']:>8}  ({growth:+})")
    return "\n".join(lines)


def resolve_options(args: argparse.Namespace) -> dict[str, Any]:
    """Flags over the --soak preset over the defaults, then the hard bounds."""
    base = {**DEFAULTS, **(SOAK if args.soak else {})}
    opts = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    if args.rps is not None:
        opts["concurrency"] = None  # open loop instead of a fixed number of workers
    opts["faults"] = list(parse_faults(opts["faults"]))
    opts["url"] = check_loopback(args.url)
    checks = [(0 < opts["duration"] <= MAX_DURATION_S, f"--duration in (0, {MAX_DURATION_S}]"),
              (0 < opts["max_requests"] <= MAX_REQUESTS, f"--max-requests in 1..{MAX_REQUESTS}"),
              (opts["rps"] is None or 0 < opts["rps"] <= MAX_RPS, f"--rps in (0, {MAX_RPS}]"),
              (opts["concurrency"] is None or 0 < opts["concurrency"] <= MAX_CONCURRENCY,
               f"--concurrency in 1..{MAX_CONCURRENCY}"),
              (not opts["faults"] or opts["fault_every"] > 0, "--fault-every > 0")]
    for ok, rule in checks:
        if not ok:
            raise ValueError(f"out of bounds: {rule}")
    opts.update(seed=args.seed, prometheus_down_s=args.prometheus_down, config=args.config,
                request_timeout_s=args.request_timeout, soak=args.soak)
    return opts


# -- the cluster side (needs Ray, psutil and a running cluster) ----------------------------------
class Cluster:
    """Finds Serve actors through Ray's state API and injects the faults."""

    def __init__(self, config: str | None, rng: random.Random) -> None:
        from cluster.local import ensure_token_auth

        ensure_token_auth()  # a Ray client without RAY_AUTH_MODE=token is refused
        self.config = config
        self.rng = rng
        self.prometheus_stopped = False
        self._ray = None

    def _connect(self):
        if self._ray is None:
            import ray

            ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
            self._ray = ray
        return self._ray

    def actors(self) -> list[dict[str, Any]]:
        from ray.util.state import list_actors

        from cluster.local import dashboard_url

        # Through the local dashboard's state API: listing needs no driver connection (ray.init
        # is only for ray.kill), so a load-only run stays light.
        return [a if isinstance(a, dict) else asdict(a) for a in
                list_actors(address=dashboard_url(None), filters=[("state", "=", "ALIVE")],
                            limit=10_000, detail=True, raise_on_missing_output=False)]

    def memory(self) -> dict[str, dict[str, Any]]:
        """RSS per role, summed over the role's processes and their children (an engine
        replica's memory is mostly in its EngineCore and worker children)."""
        import psutil

        out: dict[str, dict[str, Any]] = {}
        for a in self.actors():
            role = process_role(a.get("class_name") or "")
            if role is None or not a.get("pid"):
                continue
            try:
                proc = psutil.Process(a["pid"])
                tree = [proc, *proc.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in tree if p.is_running())
            except psutil.Error:
                continue  # died between the listing and now (a fault), or on another node
            slot = out.setdefault(role, {"processes": 0, "rss_mb": 0.0})
            slot["processes"] += 1
            slot["rss_mb"] = round(slot["rss_mb"] + rss / 2 ** 20, 1)
        return dict(sorted(out.items()))

    def _pick_engine_replica(self) -> dict[str, Any]:
        replicas = engine_replicas(self.actors())
        if not replicas:
            raise RuntimeError("no alive engine replica actor found")
        return self.rng.choice(sorted(replicas, key=lambda a: a["name"]))

    def kill_replica(self) -> str:
        ray = self._connect()
        a = self._pick_engine_replica()
        # no_restart: Serve's controller, not Ray, must notice and replace the replica.
        ray.kill(ray.get_actor(a["name"], namespace=a.get("ray_namespace") or "serve"),
                 no_restart=True)
        return f"actor {a['name']} (pid {a.get('pid')})"

    def kill_engine(self) -> str:
        import psutil

        a = self._pick_engine_replica()
        replica = psutil.Process(a["pid"])
        # Guard against a pid that was reused (or belongs to another node's numbering).
        if "ServeReplica" not in " ".join(replica.cmdline()):
            raise RuntimeError(f"pid {a['pid']} is not {a['class_name']} on this machine")
        kids = [(c.pid, c.name(), c.cmdline()) for c in replica.children(recursive=True)]
        pids = engine_core_pids(kids)
        if not pids:
            raise RuntimeError(f"no EngineCore child under replica pid {a['pid']}")
        os.kill(pids[0], signal.SIGKILL)
        return f"EngineCore pid {pids[0]} of {a['name']}"

    def stop_prometheus(self) -> str:
        from cluster.monitoring_stack import stop_monitoring

        if not stop_monitoring():
            # not ours or not running: nothing to restart later either
            raise RuntimeError("no Prometheus started by `embedfleet up` is running")
        self.prometheus_stopped = True
        return "stopped"

    def start_prometheus(self) -> str:
        from cluster.monitoring_stack import start_monitoring
        from deployments.config import load_config

        url = start_monitoring(load_config(self.config))
        self.prometheus_stopped = False
        return f"restarted at {url}"


# -- the run ----------------------------------------------------------------------------------
async def _load(opts: dict[str, Any], models: list[str], tally: Tally, deadline: float) -> None:
    import httpx

    rng = random.Random(opts["seed"])
    cap = opts["concurrency"] or min(MAX_CONCURRENCY, max(8, int(4 * opts["rps"])))
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    async with httpx.AsyncClient(base_url=opts["url"], timeout=opts["request_timeout_s"],
                                 limits=limits) as client:

        async def one() -> None:  # the caller has counted it as sent
            body, n = mixed_request(rng, models)
            t = time.perf_counter()
            try:
                resp = await client.post("/v1/embeddings", json=body)
                try:
                    payload = resp.json()
                except ValueError:
                    payload = None
                outcome = classify(resp.status_code, payload, n)
            except httpx.TimeoutException:
                outcome = "timeout"
            except httpx.TransportError:
                outcome = "connection_error"
            tally.record(outcome, time.perf_counter() - t)

        def more() -> bool:
            return time.monotonic() < deadline and tally.sent < opts["max_requests"]

        if opts["concurrency"]:  # closed loop: N workers, each sends when its last one returns
            async def worker() -> None:
                while more():
                    tally.sent += 1
                    await one()
            await asyncio.gather(*(worker() for _ in range(opts["concurrency"])))
            return
        # Open loop at a fixed rate. The in-flight cap keeps a stalled cluster from piling up
        # unbounded client-side work; the report shows the rate actually achieved.
        gate, tasks, start = asyncio.Semaphore(cap), set(), time.monotonic()

        async def gated() -> None:
            try:
                await one()
            finally:
                gate.release()
        while more():
            await asyncio.sleep(max(0.0, start + tally.sent / opts["rps"] - time.monotonic()))
            await gate.acquire()
            if not more():
                gate.release()
                break
            tally.sent += 1
            task = asyncio.create_task(gated())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)


async def _faults(opts: dict[str, Any], cluster: Cluster, t0: float, log: list[dict],
                  restarts: list[asyncio.Task], done: asyncio.Event) -> None:
    """Inject the scheduled faults until ``done``; blocking Ray/psutil calls run in a thread so
    the load continues meanwhile."""
    actions = {"kill-replica": cluster.kill_replica, "kill-engine": cluster.kill_engine,
               "stop-prometheus": cluster.stop_prometheus}
    for at, kind in fault_schedule(opts["duration"], opts["fault_every"], opts["faults"]):
        try:
            await asyncio.wait_for(done.wait(), max(0.0, t0 + at - time.monotonic()))
            return  # the load ended first (e.g. --max-requests reached)
        except asyncio.TimeoutError:
            pass
        entry: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 1), "kind": kind}
        try:
            entry["target"] = await asyncio.to_thread(actions[kind])
            entry["ok"] = True
        except Exception as exc:  # a fault that could not be injected is reported, not fatal
            entry.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        log.append(entry)
        print(f"fault t={entry['t_s']}s {kind}: {entry.get('target') or entry.get('error')}",
              flush=True)
        if kind == "stop-prometheus" and entry["ok"]:
            restarts.append(asyncio.create_task(
                _restart_prometheus(opts, cluster, log, t0, done)))


async def _restart_prometheus(opts: dict[str, Any], cluster: Cluster, log: list[dict],
                              t0: float, done: asyncio.Event) -> None:
    """Restart after the down time, or as soon as the load is over. Never cancelled: cancelling
    a thread's await leaves the thread running, and a second start could race it."""
    try:
        await asyncio.wait_for(done.wait(), opts["prometheus_down_s"])
    except asyncio.TimeoutError:
        pass
    entry: dict[str, Any] = {"kind": "restart-prometheus"}
    try:
        entry.update(target=await asyncio.to_thread(cluster.start_prometheus), ok=True)
    except Exception as exc:
        entry.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    log.append({"t_s": round(time.monotonic() - t0, 1), **entry})


async def run(opts: dict[str, Any]) -> dict[str, Any]:
    models = opts.get("models") or _served_models(opts["url"])
    cluster = Cluster(opts["config"], random.Random(opts["seed"] + 1))
    mem_start = await asyncio.to_thread(_safe_memory, cluster)
    tally, log, wall = await drive(
        opts, cluster, lambda tally, deadline: _load(opts, models, tally, deadline))
    mem_end = await asyncio.to_thread(_safe_memory, cluster)
    return build_report({**opts, "models": models}, tally, wall, log, mem_start, mem_end)


async def drive(opts: dict[str, Any], cluster: Any, load) -> tuple[Tally, list[dict], float]:
    """Run ``load(tally, deadline)`` with the fault schedule beside it; on the way out (also on
    an error or Ctrl-C) wait for a fault being injected and restart a stopped Prometheus."""
    tally, log, restarts = Tally(), [], []
    t0 = time.monotonic()
    done = asyncio.Event()
    fault_task = asyncio.create_task(_faults(opts, cluster, t0, log, restarts, done))
    try:
        await load(tally, t0 + opts["duration"])
    finally:
        # Not cancel(): a fault being injected finishes, so its state is known; a pending
        # Prometheus restart happens now rather than after its delay.
        done.set()
        await asyncio.gather(fault_task, return_exceptions=True)
        await asyncio.gather(*restarts, return_exceptions=True)
        if cluster.prometheus_stopped:  # a restart failed, or never got scheduled
            log.append({"t_s": round(time.monotonic() - t0, 1), "kind": "restart-prometheus",
                        "ok": True, "target": cluster.start_prometheus()})
    return tally, log, time.monotonic() - t0


def _served_models(url: str) -> list[str]:
    import httpx

    try:
        return [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
        raise SystemExit(f"cannot list models at {url}/v1/models ({err!r}); is the cluster up "
                         "(`embedfleet up`)?") from None


def _safe_memory(cluster: Cluster) -> dict[str, dict[str, Any]]:
    try:
        return cluster.memory()
    except Exception as exc:  # no Ray access: the load report still stands
        print(f"memory not measured: {type(exc).__name__}: {exc}")
        return {}


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
    p.add_argument("--config", help="the cluster's embedfleet config (Prometheus restart)")
    p.add_argument("--prometheus-down", type=float, default=20.0,
                   help="seconds Prometheus stays stopped")
    p.add_argument("--request-timeout", type=float, default=60.0)
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
    if args.min_success_ratio is not None and (ratio or 0) < args.min_success_ratio:
        print(f"FAIL: success ratio {ratio} < {args.min_success_ratio}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
