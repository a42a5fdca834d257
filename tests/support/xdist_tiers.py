"""The suite on two pytest-xdist workers (`make test`: ``-n 2 --dist loadgroup``).

Every test that is not a unit test (the ``cluster``, ``engine``, ``prometheus`` and
``ascend_install`` tiers, and the ``late`` ones) goes to ONE worker as one xdist group, in the
session's order (tests/conftest.py): they share the session cluster, its Ray head, the ports and
the background runs, and their timings assume nothing else heavy of theirs runs beside them. The
unit tier has no cluster, port or shared state, so the other worker runs it meanwhile: beside
the engine tier and the session cluster's start, where it ran before, one core at a time.

Before the first ``cluster`` test, the serial worker waits for every other worker to end, so no
unit test (a stand-in HAProxy, say, that tests/test_e2e_cluster.py would count) runs beside the
cluster tests. Without xdist (``-n 0``, or a single file) none of this applies.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

SERIAL = "serial"
NOT_UNIT = ("cluster", "engine", "prometheus", "ascend_install", "late")
# A unit worker ends minutes before the serial one reaches its cluster tests; this bounds the
# wait if one never reports (its tests have their own 30-minute timeout).
UNIT_WORKERS_WAIT_S = 1800


def is_unit(item: pytest.Item) -> bool:
    return not any(item.get_closest_marker(m) for m in NOT_UNIT)


def worker(config: pytest.Config) -> dict | None:
    """pytest-xdist's worker input (workerid, workercount, testrunuid), None outside a worker."""
    return getattr(config, "workerinput", None)


def _done_file(state: Path, testrunuid: str, workerid: str) -> Path:
    return state / f"xdist-{testrunuid}-{workerid}.done"


def mark_done(config: pytest.Config, state: Path) -> None:
    """A worker's session ended (tests/conftest.py pytest_sessionfinish)."""
    w = worker(config)
    if w is not None:
        state.mkdir(parents=True, exist_ok=True)
        _done_file(state, w["testrunuid"], w["workerid"]).touch()


def wait_for_other_workers(config: pytest.Config, state: Path) -> None:
    """Block until every other worker of this run has ended (or UNIT_WORKERS_WAIT_S passed)."""
    w = worker(config)
    if w is None:
        return
    others = [f"gw{i}" for i in range(int(w["workercount"])) if f"gw{i}" != w["workerid"]]
    deadline = time.monotonic() + UNIT_WORKERS_WAIT_S
    while time.monotonic() < deadline:
        done = [_done_file(state, w["testrunuid"], o) for o in others]
        if all(f.exists() for f in done):
            for f in done:
                f.unlink(missing_ok=True)
            return
        time.sleep(1)
    print(f"xdist: {others} not done after {UNIT_WORKERS_WAIT_S} s; the cluster tests start")
