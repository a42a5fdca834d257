"""`embedfleet bench`: embedfleet against bare vLLM, vLLM's own server and Infinity, in one run.

    embedfleet bench --quick                                  # smoke test: every peer, tiny sizes
    embedfleet bench --peers vllm,vllm-serve,infinity         # no cluster needed
    embedfleet bench --repeats 7 --workloads short,mixed      # more repeats, fewer workloads
    embedfleet bench --workloads short --batch 1 --concurrency 16    # ad-hoc online traffic
    embedfleet bench --workloads rerank --peers vllm,vllm-serve,embedfleet   # issue 42's rerank
    python -m embedfleet.benchmarks.bench ...                            # the same without the CLI

Peers (benchmarks/peers.py, server_peers.py, embedfleet_peer.py): `vllm` (AsyncLLM in-process, the
engine's limit), `vllm-serve` (vLLM's OpenAI server), `infinity` (Infinity from .venv-infinity;
`make bench-setup` creates it), `embedfleet` (one replica over HTTP; started with `embedfleet up`
when nothing answers at --embedfleet-url). Same model, engine arguments, cores, seeded texts,
texts per request and concurrency for all.

Workloads (benchmarks/workloads.py): short, mixed, shared-instruction, long (--batch texts per
request, --concurrency in flight; long: one document per request), online (short queries, 1 per
request, 16 in flight) and router-overhead (1 text, 1 in flight: per-request latency), plus the
prefix-cache comparison and, asked for by name, prefix-affinity (benchmarks/affinity_bench.py:
affinity routing vs Serve's default router, on a 4-card cluster of its own) and lanes
(benchmarks/lanes_bench.py: interactive latency under a bulk flood, on 2 replicas) and rerank
(benchmarks/rerank_bench.py: a query + 32 documents a request to /v1/rerank on a reranker - the
tiny random-weight Qwen3 one, or --rerank-model - served by peers of its own, after the others;
its runs count pairs as texts, so its texts/s is pairs/s and its CPU is per 1,000 pairs).

Runs (benchmarks/bench_runs.py) alternate: for each repeat, for each workload, every peer in
turn (the order rotates per repeat), so slow drift on a shared machine spreads over all peers
instead of biasing one. Warm-up is untimed and uses other texts. The summary is the median of the
repeats (5 by default: the issue's goals are judged only on medians of >= 5). A few texts per
workload are embedded by every peer and compared with `vllm`'s vectors (cosine >= 0.999).

CPU (benchmarks/process_cpu.py, ray_cluster_scope.py): each timed run also measures user+system
CPU of the peer's whole process tree, reported as CPU-s per 1,000 texts:
  vllm        this process (AsyncLLM's front end, and the load driver: one process, not
              separable; `cpu_accounting.in_process_driver` measures the driver alone on a no-op
              peer) and its descendants (vLLM engine core, workers), minus the server peers'
              subtrees;
  vllm-serve, infinity   the server subprocess and all its descendants;
  embedfleet  every process of the Ray cluster behind --embedfleet-url (Ray daemons, dashboard
              and agents, Serve controller and proxy, router, every replica with its engine core
              and workers, idle replicas of other models included) and its Prometheus.
For the HTTP peers the load driver (this process: HTTP client, JSON, base64 decoding) is
measured apart and reported as driver CPU-s per 1,000 texts, never added to the peer's figure.

With the embedfleet peer up, the bytes per vector of every encoding_format are measured from its
answers (benchmarks/encodings_bench.py).

Writes report.json (benchmarks/report.py: every run, the summary, the goals, the machine) and
chart.png to --out, and prints (benchmarks/report_text.py) a table, the CPU figures and the goals
(met / NOT met / needs >= 5 repeats). Exit status 1 when a peer failed, a run errored or vectors
disagree (skips and unmet goals are not failures: the report says why each one was skipped).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import report as rpt
from .bench_runs import compare_peers, cpu_accounting, start_peers
from .chart import write_chart
from .encodings_bench import measure_encodings
from .load_driver import batch_size, concurrency_of, driver_calibration
from .report_text import closing_lines, summary_table
from .workloads import FULL, NAMES, QUICK, Workload, build

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
ALL_PEERS = ("vllm", "vllm-serve", "infinity", "embedfleet")
ALL_WORKLOADS = (*NAMES, "prefix-cache", "prefix-affinity", "lanes", "rerank")
# Each starts a cluster of its own (benchmarks/affinity_bench.py, lanes_bench.py,
# rerank_bench.py): asked for by name.
BY_NAME_ONLY = ("prefix-affinity", "lanes", "rerank")
DEFAULT_WORKLOADS = tuple(w for w in ALL_WORKLOADS if w not in BY_NAME_ONLY)
DEFAULT_REPEATS = 5  # the figures are medians of >= 5 alternating repeats


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="embedfleet bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"tiny workloads ({QUICK.short} short texts, {QUICK.long} long "
                        "documents, ...), 1 repeat, 1 warm-up request: a smoke test of every "
                        "peer, not a measurement")
    p.add_argument("--repeats", type=int, help=f"timed passes per peer and workload "
                   f"(default {DEFAULT_REPEATS}; 1 with --quick); the summary is their median, "
                   f"and a goal is judged only on >= {rpt.MIN_GOAL_REPEATS}")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (online and "
                   "router-overhead carry their own: 16 and 1)")
    p.add_argument("--batch", type=int, default=32, help="texts per request (long, online and "
                   "router-overhead send one text or document per request)")
    p.add_argument("--peers", default=",".join(ALL_PEERS),
                   help=f"comma-separated subset of {','.join(ALL_PEERS)}")
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help=f"comma-separated subset of {','.join(ALL_WORKLOADS)} (default: all but "
                        f"{' and '.join(BY_NAME_ONLY)}, which start clusters of their own)")
    p.add_argument("--out", type=Path, help="output folder (default "
                   "benchmarks/results/bench-<timestamp>/)")
    p.add_argument("--embedfleet-url", default="http://127.0.0.1:8000")
    p.add_argument("--embedfleet-model", default=None,
                   help="model name on the embedfleet cluster (default: the bench config's)")
    p.add_argument("--cores", default=None, help="cores every engine is pinned to, e.g. 0-1 or "
                   "0,1 (VLLM_CPU_OMP_THREADS_BIND; Infinity gets the same affinity); "
                   "default: all cores this process may use")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--rerank-model", type=Path, default=None, help="reranker folder for the "
                   "rerank workload (default: the tiny random-weight Qwen3 reranker, built on "
                   "demand under .cache/models)")
    a = p.parse_args(argv)
    a.peer_list = _subset(p, a.peers, ALL_PEERS, "--peers")
    a.workload_list = _subset(p, a.workloads, ALL_WORKLOADS, "--workloads")
    a.repeats = a.repeats or (1 if a.quick else DEFAULT_REPEATS)
    for name in ("repeats", "concurrency", "batch"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    try:
        a.core_list = parse_cores(a.cores) if a.cores else sorted(os.sched_getaffinity(0))
    except ValueError as err:
        p.error(str(err))
    return a


def _subset(p: argparse.ArgumentParser, value: str, allowed: tuple[str, ...], flag: str
            ) -> list[str]:
    items = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        p.error(f"{flag}: unknown {bad or 'empty list'}; choose from {', '.join(allowed)}")
    return [x for x in allowed if x in items]  # canonical order, no duplicates


def parse_cores(spec: str) -> list[int]:
    """``0-3``, ``0,2`` or ``0-1,4`` -> sorted core ids."""
    cores: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"--cores: cannot read {spec!r} (use e.g. 0-1 or 0,1)")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cores)


def machine_info(cores: list[int]) -> dict[str, Any]:
    import psutil
    import torch
    import vllm

    from .embedfleet_peer import ray_ports_taken
    from .server_peers import infinity_version

    cpu = next((ln.split(":", 1)[1].strip() for ln in _read("/proc/cpuinfo").splitlines()
                if ln.startswith("model name")), platform.processor())
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=ROOT).stdout.strip()
    return {"cpu_model": cpu, "cores": os.cpu_count(), "cores_used": len(cores),
            "core_ids": cores, "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version(),
            "vllm": vllm.__version__, "torch": torch.__version__,
            "infinity": infinity_version(), "git_commit": git or None,
            "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
            # another Ray cluster on the machine competes for the same cores: note it
            "ray_head_ports_in_use": ray_ports_taken()}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def make_peers(args: argparse.Namespace, cfg: Any, out: Path, concurrency: int) -> list[Any]:
    """``concurrency``: the most requests any workload keeps in flight (the HTTP peers' client
    pools hold that many connections, so a 16-in-flight workload is not capped by the pool)."""
    from .embedfleet_peer import EmbedfleetPeer
    from .peers import VllmInProcessPeer
    from .server_peers import InfinityPeer, VllmServePeer

    m = cfg.models[0]
    # Exactly what benchmarks/throughput.py run_vllm does; MiniLM is bidirectional, so
    # embedfleet's prefix-cache policy turns the cache off for it too.
    kw = cfg.engine_kwargs(m, enable_prefix_caching=False)
    make = {
        "vllm": lambda: VllmInProcessPeer("vllm", kw, m.long_input),
        "vllm-serve": lambda: VllmServePeer(kw, concurrency, out, args.core_list),
        "infinity": lambda: InfinityPeer(kw, concurrency, out, args.core_list),
        "embedfleet": lambda: EmbedfleetPeer(args.embedfleet_url,
                                             args.embedfleet_model or m.name, concurrency,
                                             cfg, out, args.core_list),
    }
    return [make[name]() for name in args.peer_list]


def workload_info(w: Workload, tokens: int, lengths: list[int], batch: int,
                  concurrency: int) -> dict[str, Any]:
    lengths = sorted(lengths)
    return {"description": w.description, "texts": len(w.texts), "tokens": tokens,
            "tokens_min": lengths[0], "tokens_median": lengths[len(lengths) // 2],
            "tokens_max": lengths[-1], "seed": w.seed, "texts_per_request": batch_size(w, batch),
            "concurrency": concurrency_of(w, concurrency),
            "warmup_texts": len(w.warmup), "probe_texts": len(w.probe),
            "chunked": w.chunked, "params": w.params}


async def run(args: argparse.Namespace, out: Path, console: Any) -> dict[str, Any]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )
    from transformers import AutoTokenizer

    from .embedfleet_peer import bench_config
    from .prefix_cache_bench import run_prefix_cache
    from ..deployments.config.schema import load_config

    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    machine = machine_info(args.core_list)  # before the run: the load average says how idle
    sizes = QUICK if args.quick else FULL
    cfg = bench_config(load_config(None), args.embedfleet_url)
    m = cfg.models[0]
    model_path = m.source.resolve()
    max_len = m.max_model_len or 512
    tok = AutoTokenizer.from_pretrained(model_path)
    tok.model_max_length = 1 << 30  # count long documents whole; never truncate here
    workloads: dict[str, Workload] = {}
    tokens: dict[str, int] = {}
    winfo: dict[str, Any] = {}
    for name in (n for n in args.workload_list if n in NAMES):
        w = build(name, sizes, max_len=max_len, batch=args.batch, seed=args.seed)
        lengths = [len(i) for i in tok(w.texts, add_special_tokens=True)["input_ids"]]
        if not w.chunked and max(lengths) > max_len:
            raise RuntimeError(f"workload {name}: a text has {max(lengths)} tokens > {max_len}")
        workloads[name], tokens[name] = w, sum(lengths)
        winfo[name] = workload_info(w, tokens[name], lengths, args.batch, args.concurrency)
    max_conc = max([args.concurrency, *(concurrency_of(w, args.concurrency)
                                        for w in workloads.values())])
    peers = make_peers(args, cfg, out, max_conc) if workloads else []
    calibration = await driver_calibration() if "vllm" in args.peer_list and peers else None
    do_pc = "prefix-cache" in args.workload_list
    pc_possible = "vllm" in args.peer_list
    total = args.repeats * (len(workloads) * len(peers) + (2 if do_pc and pc_possible else 0))
    peer_status: dict[str, dict[str, Any]] = {}
    runs: list = []
    skipped: list = []
    probes: dict = {}
    prefix_cache = prefix_affinity = lanes = encodings = rerank = None
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        overall = progress.add_task("[bold]all runs", total=total)
        try:
            if peers:
                peer_status = await start_peers(peers, progress.console)
                active = [p for p in peers if peer_status[p.name]["status"] == "ok"]
                progress.update(overall, total=total - args.repeats * len(workloads)
                                * (len(peers) - len(active)))
                runs, skipped, probes = await compare_peers(args, active, workloads, tokens,
                                                            progress, overall, peers)
                if any(p.name == "embedfleet" for p in active):  # while it is up
                    encodings = await measure_encodings(
                        args.embedfleet_url, m.name, next(iter(workloads.values())).texts[:32])
        finally:
            cpu_info = cpu_accounting([p for p in peers
                                       if peer_status.get(p.name, {}).get("status") == "ok"],
                                      calibration)
            for p in peers:
                try:
                    peer_status.setdefault(p.name, {"status": "failed", "reason": "interrupted"})
                    peer_status[p.name]["info"] = p.describe()
                    await p.stop()
                except Exception as exc:  # noqa: BLE001 - stop the others regardless
                    progress.console.print(f"[red]{p.name}: stop failed: {exc}[/red]")
        if "rerank" in args.workload_list:  # after the peers: its own model and peers
            from .rerank_bench import run_rerank

            rerank_runs, winfo["rerank"], rerank = await run_rerank(
                args, load_config(None), out, progress.console)
            runs = [*runs, *rerank_runs]
        if do_pc and pc_possible:
            prefix_cache = await run_prefix_cache(
                sizes=sizes, repeats=args.repeats, batch=args.batch,
                concurrency=args.concurrency, seed=args.seed, progress=progress, overall=overall)
        elif do_pc:
            prefix_cache = {"status": "skipped", "summary": None,
                            "reason": "the prefix-cache comparison runs in bare vLLM: add "
                                      "`vllm` to --peers"}
        if "prefix-affinity" in args.workload_list:  # after the peers: its own cluster
            from .affinity_bench import run_prefix_affinity

            prefix_affinity = await run_prefix_affinity(
                url=args.embedfleet_url, out=out, cores=args.core_list, repeats=args.repeats,
                quick=args.quick, seed=args.seed, progress=progress)
        if "lanes" in args.workload_list:
            from .lanes_bench import run_lanes

            lanes = await run_lanes(url=args.embedfleet_url, out=out, cores=args.core_list,
                                    repeats=args.repeats, quick=args.quick, progress=progress)
    peer_status = {name: peer_status.get(name, {"status": "skipped",
                                                "reason": "no workload for it"})
                   for name in args.peer_list}
    settings = {"quick": args.quick, "repeats": args.repeats, "concurrency": args.concurrency,
                "batch": args.batch, "peers": args.peer_list, "workloads": args.workload_list,
                "cores": args.core_list, "seed": args.seed,
                "warmup_requests": sizes.warmup_requests, "probe_texts": sizes.probe_texts,
                "encoding_format": "base64", "order": "per repeat: per workload: each peer in "
                "turn, the order rotated by one each repeat",
                "model": m.name, "model_path": model_path, "max_model_len": max_len,
                "long_input_policy": m.long_input.model_copy(update={"mode": "chunk"})
                .model_dump(),
                "embedfleet_url": args.embedfleet_url, "rerank_model": args.rerank_model}
    return rpt.build_report(
        command=sys.argv, started_at=started, finished_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        machine=machine, settings=settings, workloads=winfo,
        peers=peer_status, runs=runs, skipped=skipped, probes=probes, prefix_cache=prefix_cache,
        prefix_affinity=prefix_affinity, lanes=lanes, cpu_accounting=cpu_info,
        encodings=encodings, rerank=rerank)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Before vLLM is imported anywhere: offline, quieter logs (the progress display stays
    # readable), and the same core binding for the in-process engines and every child process.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from .peers import cpu_env

    os.environ.update(cpu_env(args.core_list))
    from rich.console import Console
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # "sequence longer than 512" for long documents: intended
    # Not a terminal (make test, a log file): rich would wrap the table at 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=180)
    out = args.out or RESULTS / f"bench-{time.strftime('%Y%m%dT%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    report = asyncio.run(run(args, out, console))
    report["settings"]["wall_s"] = round(time.monotonic() - t0, 1)
    problems = rpt.check_schema(report)
    if problems:
        raise AssertionError(f"report does not match its schema: {problems}")
    rpt.write_json(report, out / "report.json")
    write_chart(report, out / "chart.png")
    console.print(summary_table(report))
    for line in closing_lines(report):
        console.print(line)
    console.print(f"wrote {out / 'report.json'} and {out / 'chart.png'} "
                  f"({report['settings']['wall_s']:.0f} s)")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
