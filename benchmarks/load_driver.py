"""One timed pass of a peer over a workload: fixed batches, fixed concurrency, latency per request.

Shared by the peer comparison (benchmarks/bench.py) and the prefix-cache comparison
(benchmarks/prefix_cache_bench.py), so both measure exactly the same way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from embedfleet.benchmarks.report import run_record
from embedfleet.benchmarks.workloads import Workload, batches


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


async def warm_up(peer: Any, workload: Workload, batch: int, requests: int,
                  concurrency: int) -> None:
    """Untimed requests from the workload's warm-up texts (never the measured ones)."""
    warm = batches(workload.warmup, batch_size(workload, batch))[:max(1, requests)]
    await drive(lambda b: peer.embed(b, workload), warm, concurrency)


async def timed_run(peer: Any, workload: Workload, *, repeat: int, tokens: int, batch: int,
                    concurrency: int, on_done: Callable[[], None] | None = None
                    ) -> dict[str, Any]:
    """One run record; an exception becomes the record's ``error`` instead of ending the bench."""
    reqs = batches(workload.texts, batch_size(workload, batch))
    try:
        lat, wall = await drive(lambda b: peer.embed(b, workload), reqs, concurrency, on_done)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported per run, the other peers still run
        lat, wall = [], 0.0
        error = describe_error(exc)
    return run_record(repeat=repeat, workload=workload.name, peer=peer.name, latencies=lat,
                      seconds=wall, texts=len(workload.texts), tokens=tokens, error=error)


def describe_error(exc: BaseException) -> str:
    """``Type: message`` of the first real error (a TaskGroup wraps it in an ExceptionGroup)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"[:500]
