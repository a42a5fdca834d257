"""The timed part of `embedfleet bench`: start the peers, run the alternating repeats with a CPU
meter around each run, probe the vectors, and say what each peer's CPU figure counts.

``bench.run`` calls these in order; the runs go: for each repeat, for each workload, every peer
in turn (the order rotated by one each repeat). See benchmarks/bench.py's docstring for the whole.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import traceback
from typing import Any

from . import report as rpt
from .load_driver import (batch_size, concurrency_of, describe_error,
                          timed_run, warm_up)
from .workloads import FULL, QUICK, Workload


def cpu_meter(peer: Any, peers: list[Any]) -> Any:
    """The meter of one run of ``peer``: its own processes (``peer``) and, for a peer outside
    this process, the load driver - this process alone, its threads, not its children."""
    from .process_cpu import CpuMeter, OwnProcess

    scopes = {"peer": peer.cpu_scope([p for p in peers if p is not peer])}
    if not getattr(peer, "in_process", False):  # else its scope already holds this process
        scopes["driver"] = OwnProcess(os.getpid(), "load driver (bench process)")
    return CpuMeter(scopes)


def cpu_accounting(peers: list[Any], calibration: dict[str, Any] | None) -> dict[str, Any]:
    """What each peer's CPU figure counts, for the report."""
    out: dict[str, Any] = {
        "unit": "CPU-s (user + system) per 1,000 texts embedded in the timed run",
        "method": "process_cpu.CpuMeter: per-pid deltas between a reading just before and just "
                  "after the requests; processes that appear count in full, processes that "
                  "exit are recovered from their measured parent's reaped-children time "
                  "(`lost` counts those that could not be; `left`, those re-parented out of "
                  "the tree alive, e.g. a detached daemon: neither is counted)",
        "driver": "the load driver runs in the bench process: for vllm-serve, infinity and "
                  "embedfleet it is measured apart (driver_cpu_s_per_1k: this process alone, "
                  "HTTP client, JSON, base64 decoding) and not part of the peer's figure; for "
                  "vllm it is inside the peer's figure (AsyncLLM's front end shares the process)",
        "in_process_driver": calibration, "peers": {}}
    for p in peers:
        try:
            out["peers"][p.name] = p.cpu_scope([o for o in peers if o is not p]).describe()
        except Exception as exc:  # noqa: BLE001 - a description must not end the report
            out["peers"][p.name] = {"error": describe_error(exc)}
    return out


async def start_peers(peers: list[Any], console: Any) -> dict[str, dict[str, Any]]:
    """Start every peer at once (their start-ups overlap; nothing is timed yet). Each gets a
    status: ok, skipped (cannot run here, with what to do) or failed (with the error)."""
    from .peers import PeerUnavailable

    async def one(p: Any) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            await p.start()
        except PeerUnavailable as exc:
            console.print(f"[yellow]{p.name}: skipped: {exc}[/yellow]")
            return {"status": "skipped", "reason": str(exc)}
        except Exception as exc:  # noqa: BLE001 - one broken peer must not hide the others
            console.print(f"[red]{p.name}: failed to start: {exc}[/red]")
            return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[-2000:],
                    "traceback": traceback.format_exc()[-3000:]}
        console.print(f"{p.name}: up in {time.monotonic() - t0:.0f} s")
        return {"status": "ok", "startup_s": round(time.monotonic() - t0, 1)}

    # Subprocess peers launch first; the in-process engine is built last because building it
    # blocks the event loop for its whole start-up (the others keep starting meanwhile).
    tasks = {p.name: asyncio.ensure_future(one(p)) for p in peers if p.name != "vllm"}
    await asyncio.sleep(0.1)
    status = {p.name: await one(p) for p in peers if p.name == "vllm"}
    for name, t in tasks.items():
        status[name] = await t
    return status


async def compare_peers(args: argparse.Namespace, peers: list[Any],
                        workloads: dict[str, Workload], tokens: dict[str, int], progress: Any,
                        overall: Any, all_peers: list[Any] | None = None
                        ) -> tuple[list, list, dict]:
    """``peers``: the ones that started; ``all_peers``: every peer made (whose processes must
    not be counted as another's)."""
    all_peers = all_peers if all_peers is not None else peers
    runs: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    probes: dict[str, dict[str, list[Any]]] = {}
    sizes = QUICK if args.quick else FULL
    for rep in range(args.repeats):
        for w in workloads.values():
            order = peers[rep % len(peers):] + peers[:rep % len(peers)] if peers else []
            conc = concurrency_of(w, args.concurrency)
            for p in order:
                if reason := p.skip_reason(w):
                    if rep == 0:
                        skipped.append({"workload": w.name, "peer": p.name, "reason": reason})
                    progress.advance(overall)
                    continue
                reqs = -(-len(w.texts) // batch_size(w, args.batch))
                task = progress.add_task(f"{w.name} · {p.name} · repeat {rep + 1}", total=reqs)
                try:
                    await warm_up(p, w, args.batch, sizes.warmup_requests if rep == 0 else 1,
                                  conc)
                except Exception as exc:  # noqa: BLE001 - recorded as this run's error
                    runs.append(rpt.run_record(
                        repeat=rep, workload=w.name, peer=p.name, latencies=[], seconds=0,
                        texts=len(w.texts), tokens=tokens[w.name],
                        error=f"warm-up: {describe_error(exc)}"))
                else:
                    runs.append(await timed_run(
                        p, w, repeat=rep, tokens=tokens[w.name], batch=args.batch,
                        concurrency=conc, on_done=lambda t=task: progress.advance(t),
                        cpu=cpu_meter(p, all_peers)))
                    if rep == 0 and runs[-1]["error"] is None:
                        probes.setdefault(w.name, {})[p.name] = await _probe(p, w)
                r = runs[-1]
                cpu = ("" if r.get("cpu_s_per_1k") is None else
                       f"  CPU {r['cpu_s_per_1k']:7.3f} s/1k" + (
                           f" (+ driver {r['driver_cpu_s_per_1k']:.3f})"
                           if r.get("driver_cpu_s_per_1k") is not None else ""))
                progress.console.print(
                    f"  {w.name:<18} {p.name:<10} #{rep + 1}: "
                    + (f"{r['texts_per_s']:8.1f} texts/s  p50 {r['p50_ms']:8.1f} ms{cpu}"
                       if r["error"] is None else f"[red]{r['error']}[/red]"))
                progress.remove_task(task)
                progress.advance(overall)
    return runs, skipped, probes


async def _probe(peer: Any, w: Workload) -> list[Any] | str:
    """The probe texts' vectors, or the error text (reported as a failed correctness check)."""
    try:
        return await peer.embed(w.probe, w)
    except Exception as exc:  # noqa: BLE001
        return f"probe request failed: {describe_error(exc)}"
