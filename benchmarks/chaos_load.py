"""The load of the chaos tool: seeded mixed requests, sent closed- or open-loop, and tallied one
``Sample`` per request; and the burst the flood-kill fault sends to fill a model's queues.
The report built from the samples is in chaos_report.py.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .chaos_stats import Sample
from .throughput import WORDS

# Hard ceilings: a mistyped flag must not turn a test into an unbounded flood.
MAX_DURATION_S = 3600
MAX_REQUESTS = 1_000_000
MAX_CONCURRENCY = 256
MAX_RPS = 1000
FAILURE_BACKOFF_S = 1.0  # a closed-loop worker's pause after a failure (the router's Retry-After)


# -- pure parts (unit-tested in tests/test_chaos_tool.py) ----------------------------------------
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


def burst_request(rng: random.Random, model: str) -> dict[str, Any]:
    """One short text: one sequence per call, so a burst's size counts against the admission
    bound call for call (chaos_targets.burst_size)."""
    return {"model": model, "input": " ".join(rng.choice(WORDS) for _ in range(8))}


@dataclass
class Tally:
    """Every request of the steady load, as it completed. ``t0`` is the run's start (monotonic),
    so samples can be placed in the fault windows."""

    sent: int = 0
    samples: list[Sample] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def record(self, outcome: str, latency_s: float, model: str = "_all", *,
               t_s: float | None = None, retry_after: bool = False) -> None:
        if t_s is None:  # called on completion: it was sent latency_s ago
            t_s = time.monotonic() - self.t0 - latency_s
        self.samples.append(Sample(round(t_s, 3), model, outcome, latency_s, retry_after))

    @property
    def outcomes(self) -> Counter:
        return Counter(s.outcome for s in self.samples)


# -- sending it ------------------------------------------------------------------------------
def retry_pause_s(attempt: int) -> float:
    """The OpenAI Python SDK's pause before retry ``attempt`` (1, 2, ...): 0.5 s doubling, at
    most 8 s (its jitter left out, so a seeded run repeats)."""
    return min(0.5 * 2 ** (attempt - 1), 8.0)


async def send(client: Any, body: dict[str, Any], n_inputs: int, t0: float,
               connection_retries: int = 0) -> Sample:
    """POST one request; what the client saw, as a Sample (never raises for HTTP trouble).

    ``connection_retries``: resend after a broken connection (refused, reset, cut mid-answer)
    up to this many times, as the OpenAI SDK does by default (2): a killed proxy takes its
    connections with it, and the inputs are idempotent. Timeouts and HTTP statuses are never
    retried here; the Sample counts the retries, so the report shows what they hid."""
    import httpx

    sent = time.monotonic()
    retry_after = False
    retries = 0
    while True:
        try:
            resp = await client.post("/v1/embeddings", json=body)
            retry_after = resp.headers.get("retry-after") is not None
            try:
                payload = resp.json()
            except ValueError:
                payload = None
            outcome = classify(resp.status_code, payload, n_inputs)
        except httpx.TimeoutException:
            outcome = "timeout"
        except httpx.TransportError:
            outcome = "connection_error"
            if retries < connection_retries:
                retries += 1
                await asyncio.sleep(retry_pause_s(retries))
                continue
        return Sample(round(sent - t0, 3), body.get("model", "_all"), outcome,
                      time.monotonic() - sent, retry_after, retries)


async def send_burst(url: str, model: str, size: int, timeout_s: float, t0: float,
                     seed: int = 0) -> list[Sample]:
    """``size`` one-text requests to ``model`` at once, each on its own connection, so they all
    wait in the model's queues together."""
    import httpx

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=size, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        return list(await asyncio.gather(*(send(client, burst_request(rng, model), 1, t0)
                                           for _ in range(size))))


async def run_load(opts: dict[str, Any], models: list[str], tally: Tally,
                   deadline: float) -> None:
    import httpx

    rng = random.Random(opts["seed"])
    cap = opts["concurrency"] or min(MAX_CONCURRENCY, max(8, int(4 * opts["rps"])))
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    async with httpx.AsyncClient(base_url=opts["url"], timeout=opts["request_timeout_s"],
                                 limits=limits) as client:

        async def one() -> Sample:  # the caller has counted it as sent
            body, n = mixed_request(rng, models)
            sample = await send(client, body, n, tally.t0, opts["connection_retries"])
            tally.samples.append(sample)
            return sample

        def more() -> bool:
            return time.monotonic() < deadline and tally.sent < opts["max_requests"]

        if opts["concurrency"]:  # closed loop: N workers, each sends when its last one returns
            async def worker() -> None:
                while more():
                    tally.sent += 1
                    if (await one()).outcome != "ok":
                        # As a real client does (honouring Retry-After, backing off from a
                        # refused connection): a failure's count measures how long a fault
                        # lasted, not how fast a loop can be refused.
                        await asyncio.sleep(FAILURE_BACKOFF_S)
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
