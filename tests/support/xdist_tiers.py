"""The suite on two pytest-xdist workers (`make test TEST_WORKERS=2`: ``-n 2 --dist loadgroup``).

Every test that is not a unit test (the ``cluster``, ``engine``, ``prometheus`` and
``ascend_install`` tiers, and the ``late`` ones) goes to ONE worker as one group, in the
session's order (tests/conftest.py): they share the session cluster, its Ray head, the ports and
the background runs, and their timings assume nothing else heavy of theirs runs beside them. The
unit tier has no cluster, port or shared state, so the other worker runs it meanwhile: beside
the engine tier and the session cluster's start, instead of before the cluster tests.

The group is not xdist's own ``xdist_group`` naming: xdist 3.8.0 renames a grouped test through
``item._nodeid``, which pytest 9 no longer reads (its ids are structured), so nothing was grouped
(pytest-xdist issue #1386). Instead the controller gives its workers a run id (an environment
variable, set before they start), each worker writes the serial tests' ids to a file of that run
at collection, and this module's scheduler puts every id in that file into one scope.

Before the first ``cluster`` test, the serial worker waits for every other worker to end, so no
unit test (a stand-in HAProxy, say, that tests/test_e2e_cluster.py would count) runs beside the
cluster tests. Without xdist none of this applies.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

SERIAL = "serial"
NOT_UNIT = ("cluster", "engine", "prometheus", "ascend_install", "late")
RUN_ENV = "EMBEDFLEET_XDIST_RUN"
# A unit worker ends minutes before the serial one reaches its cluster tests; this bounds the
# wait if one never reports (its tests have their own 30-minute timeout).
UNIT_WORKERS_WAIT_S = 1800


def is_unit(item: pytest.Item) -> bool:
    return not any(item.get_closest_marker(m) for m in NOT_UNIT)


def worker(config: pytest.Config) -> dict | None:
    """pytest-xdist's worker input (workerid, workercount, testrunuid), None outside a worker."""
    return getattr(config, "workerinput", None)


def start_run() -> str:
    """In the controller, before the workers start: the run id they inherit."""
    os.environ[RUN_ENV] = uuid.uuid4().hex
    return os.environ[RUN_ENV]


def _serial_file(state: Path, run: str) -> Path:
    return state / f"xdist-{run}-serial.json"


def write_serial(state: Path, items: list[pytest.Item]) -> None:
    """In each worker, after collection: the ids of the tests that must share one worker."""
    run = os.environ.get(RUN_ENV)
    if run is None:
        return
    state.mkdir(parents=True, exist_ok=True)
    dest = _serial_file(state, run)
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}")
    tmp.write_text(json.dumps([i.nodeid for i in items if not is_unit(i)]))
    tmp.replace(dest)  # both workers write the same list; each write is whole


class SerialGroupScheduling(LoadScopeScheduling):
    """xdist's scope scheduling where the serial tests are one scope and every other test is
    its own. The largest scope goes first (xdist's default reorder): one worker gets the serial
    group, the others the unit tests one by one."""

    def __init__(self, config: pytest.Config, log=None, state: Path | None = None) -> None:
        super().__init__(config, log)
        self._state = state
        self._serial: set[str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._serial is None:  # called once every worker has collected
            run = os.environ.get(RUN_ENV)
            path = _serial_file(self._state, run) if run and self._state else None
            self._serial = set(json.loads(path.read_text())) if path and path.exists() else set()
            if path:
                path.unlink(missing_ok=True)
        return SERIAL if nodeid in self._serial else nodeid


def _done_file(state: Path, testrunuid: str, workerid: str) -> Path:
    return state / f"xdist-{testrunuid}-{workerid}.done"


def mark_done(config: pytest.Config, state: Path) -> None:
    """A worker's session ended (tests/conftest.py pytest_sessionfinish); only in a run with the
    serial group, whose worker waits for it."""
    w = worker(config)
    if w is not None and os.environ.get(RUN_ENV):
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
