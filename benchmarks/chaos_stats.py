"""What clients saw, by model: the arithmetic of the chaos report; pure, so it is unit-tested.

One ``Sample`` per request. A fault's window runs from its injection to the next fault (or the
end); a request belongs to the window it started in, since that is the cluster state it met.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# The answers a client can act on: back off for Retry-After seconds and try again. Anything else
# that is not a success (a 500, a 503 without the header, a timeout, a dropped connection, a 200
# with the wrong number of vectors) is a failure the service should never give.
RETRYABLE_STATUSES = ("429", "503")
CLIENT_SIDE = ("timeout", "connection_error")


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float         # when the request was sent, seconds from the run's start
    model: str
    outcome: str       # 'ok', 'bad_200', an HTTP status ('503'), 'timeout', 'connection_error'
    latency_s: float
    retry_after: bool = False  # the response carried a Retry-After header
    retries: int = 0   # connection-level retries before this outcome (chaos_load.send)


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    data = sorted(values)
    if not data:
        return None
    rank = max(1, math.ceil(q / 100 * len(data)))
    return data[min(rank, len(data)) - 1]


def ms(values: Iterable[float], q: float) -> float | None:
    p = percentile(values, q)
    return None if p is None else round(p * 1000, 1)


def status_of(outcome: str) -> str | None:
    """The HTTP status a client got ('200' for a wrong-sized 200); None when no response came."""
    if outcome in ("ok", "bad_200"):
        return "200"
    return None if outcome in CLIENT_SIDE else outcome


def is_retryable(s: Sample) -> bool:
    return s.outcome in RETRYABLE_STATUSES and s.retry_after


def stats(samples: Iterable[Sample]) -> dict[str, Any]:
    """One group's figures: counts by status, client timeouts, whether every failure was a
    503/429 with Retry-After (vacuously true for none) and the failures that were not, and
    latency percentiles over all requests (what clients waited, failures included)."""
    group = list(samples)
    ok = [s for s in group if s.outcome == "ok"]
    failed = [s for s in group if s.outcome != "ok"]
    unclean = Counter(f"{s.outcome} without Retry-After" if s.outcome in RETRYABLE_STATUSES
                      else s.outcome for s in failed if not is_retryable(s))
    statuses = Counter(st for st in map(status_of, (s.outcome for s in group)) if st)
    return {
        "requests": len(group),
        "successes": len(ok),
        "success_pct": round(100 * len(ok) / len(group), 3) if group else None,
        "statuses": dict(sorted(statuses.items())),
        "timeouts": sum(s.outcome == "timeout" for s in group),
        "connection_errors": sum(s.outcome == "connection_error" for s in group),
        "every_failure_503_or_429_with_retry_after": not unclean,
        "other_failures": dict(sorted(unclean.items())),
        "p50_ms": ms((s.latency_s for s in group), 50),
        "p99_ms": ms((s.latency_s for s in group), 99),
        "failed_p99_ms": ms((s.latency_s for s in failed), 99),  # fail-fast: 503 within 1 s
        # What --connection-retries hid: requests whose first connection broke (refused, reset,
        # cut mid-answer) and that a retry then answered.
        "connection_retried": sum(s.retries > 0 for s in group),
        "ok_after_connection_retry": sum(s.retries > 0 and s.outcome == "ok" for s in group),
    }


def by_model(samples: Iterable[Sample]) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.model, []).append(s)
    return {m: stats(g) for m, g in sorted(groups.items())}


def fault_windows(starts: list[float], wall_s: float) -> list[tuple[float, float]]:
    """[start, end) per fault from the injection times (in order): each to the next, the last
    to the end of the run."""
    ends = [*starts[1:], max(wall_s, starts[-1] if starts else 0.0)]
    return list(zip(starts, ends))


def in_window(samples: Iterable[Sample], start: float, end: float, last: bool) -> list[Sample]:
    """Requests sent in [start, end); the last window also keeps the stragglers sent at end."""
    return [s for s in samples if start <= s.t_s < end or (last and s.t_s >= end)]


def role_memory(procs: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """RSS per role, summed over the role's process trees (an engine replica's memory is mostly
    in its EngineCore and worker children)."""
    out: dict[str, dict[str, Any]] = {}
    for p in procs:
        slot = out.setdefault(p["role"], {"processes": 0, "rss_mb": 0.0})
        slot["processes"] += 1
        slot["rss_mb"] = round(slot["rss_mb"] + p["tree_rss_mb"], 1)
    return dict(sorted(out.items()))


def memory_growth(start: dict[str, dict], end: dict[str, dict]) -> dict[str, float]:
    """Per role seen at both ends."""
    return {role: round(end[role]["rss_mb"] - start[role]["rss_mb"], 1)
            for role in sorted(set(start) & set(end))}


def process_growth(start: Iterable[dict[str, Any]],
                   end: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Per Ray worker pid: its own RSS at start and end. A pid seen at one end only was killed or
    started during the run (a fault and its replacement): listed, not compared."""
    a = {p["pid"]: p for p in start}
    b = {p["pid"]: p for p in end}
    both = sorted(set(a) & set(b), key=lambda pid: (a[pid]["role"], pid))
    return {
        "growth": {str(pid): {"role": a[pid]["role"], "start_mb": a[pid]["rss_mb"],
                              "end_mb": b[pid]["rss_mb"],
                              "growth_mb": round(b[pid]["rss_mb"] - a[pid]["rss_mb"], 1)}
                   for pid in both},
        "gone": sorted(f"{a[pid]['role']}:{pid}" for pid in set(a) - set(b)),
        "new": sorted(f"{b[pid]['role']}:{pid}" for pid in set(b) - set(a)),
    }
