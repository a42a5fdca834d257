"""One timed pass of a peer over a workload: fixed batches, fixed concurrency, latency per request.

Shared by the peer comparison (benchmarks/bench.py) and the prefix-cache comparison
(benchmarks/prefix_cache_bench.py), so both measure exactly the same way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from .report import run_record
from .workloads import Workload, batches


async def drive(send: Callable[[list[str]], Any], requests: list[list[str]], concurrency: int,
                on_done: Callable[[], None] | None = None) -> tuple[list[float], float]:
    """Send ``requests`` with ``concurrency`` in flight; (latency of each request, wall seconds).

    The first failing request ends the pass (a TaskGroup cancels the other workers), so a broken
    peer costs one error, not a timeout per remaining request.
    """
    queue: asyncio.Queue[list[str]] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    latencies: list[float] = []

    async def worker() -> None:
        while not queue.empty():
            texts = queue.get_nowait()
            t = time.perf_counter()
            await send(texts)
            latencies.append(time.perf_counter() - t)
            if on_done:
                on_done()

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(min(concurrency, len(requests))):
            tg.create_task(worker())
    return latencies, time.perf_counter() - t0


def batch_size(workload: Workload, default: int) -> int:
    return workload.batch or default


def concurrency_of(workload: Workload, default: int) -> int:
    """Requests in flight: the workload's own (``online``: 16) or the harness's."""
    return workload.concurrency or default


async def warm_up(peer: Any, workload: Workload, batch: int, requests: int,
                  concurrency: int) -> None:
    """Untimed requests from the workload's warm-up texts (never the measured ones); at least one
    per request in flight, so every connection the run uses is open before it is timed."""
    conc = concurrency_of(workload, concurrency)
    n = max(1, requests, workload.concurrency or 1)
    warm = batches(workload.warmup, batch_size(workload, batch))[:n]
    await drive(lambda b: peer.embed(b, workload), warm, conc)


async def timed_run(peer: Any, workload: Workload, *, repeat: int, tokens: int, batch: int,
                    concurrency: int, on_done: Callable[[], None] | None = None,
                    cpu: Any = None) -> dict[str, Any]:
    """One run record; an exception becomes the record's ``error`` instead of ending the bench.

    ``cpu``: a ``process_cpu.CpuMeter`` read right around the requests (its scopes: ``peer`` and,
    for peers outside this process, ``driver``); the record then carries CPU-s per 1,000 texts."""
    reqs = batches(workload.texts, batch_size(workload, batch))
    conc = concurrency_of(workload, concurrency)
    cpu_error: list[str] = []
    metering = cpu is not None and _measure(cpu.start, cpu_error) is not None
    try:
        lat, wall = await drive(lambda b: peer.embed(b, workload), reqs, conc, on_done)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported per run, the other peers still run
        lat, wall = [], 0.0
        error = describe_error(exc)
    reading = _measure(cpu.stop, cpu_error) if metering else None
    record = run_record(repeat=repeat, workload=workload.name, peer=peer.name, latencies=lat,
                        seconds=wall, texts=len(workload.texts), tokens=tokens, error=error,
                        cpu=reading)
    if cpu_error:
        record["cpu_error"] = cpu_error[0]
    return record


def _measure(step: Callable[[], Any], errors: list[str]) -> Any:
    """A CPU reading, or None (the error noted): measuring must never fail the run itself."""
    try:
        return step()
    except Exception as exc:  # noqa: BLE001 - e.g. /proc unreadable; the run's numbers stand
        errors.append(describe_error(exc))
        return None


async def driver_calibration(requests: int = 2000, concurrency: int = 16) -> dict[str, Any]:
    """CPU this process spends driving requests to a peer that does nothing: the load driver's
    own share (queue, task, timing per request) inside the in-process ``vllm`` peer's figure."""
    async def nothing(texts: list[str]) -> None:
        return None

    reqs = [["x"]] * requests
    await drive(nothing, reqs[:concurrency], concurrency)  # warm
    t0 = time.process_time()
    await drive(nothing, reqs, concurrency)
    cpu = time.process_time() - t0
    return {"requests": requests, "concurrency": concurrency, "cpu_s": round(cpu, 4),
            "cpu_s_per_1k_requests": round(1000 * cpu / requests, 4)}


def describe_error(exc: BaseException) -> str:
    """``Type: message`` of the first real error (a TaskGroup wraps it in an ExceptionGroup)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"[:500]
