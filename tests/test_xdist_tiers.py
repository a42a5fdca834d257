"""`make test` on two xdist workers (tests/support/xdist_tiers.py): which tests leave the unit
worker, and the serial worker's wait for the others before its cluster tests."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from tests.support import xdist_tiers


class Item:
    def __init__(self, *markers: str) -> None:
        self.markers = set(markers)

    def get_closest_marker(self, name: str):
        return object() if name in self.markers else None


@pytest.mark.parametrize("markers, unit", [((), True), (("cluster",), False),
                                           (("engine",), False), (("prometheus",), False),
                                           (("ascend_install",), False), (("late",), False),
                                           (("parametrize",), True)])
def test_only_unmarked_tests_are_the_unit_tier(markers, unit):
    assert xdist_tiers.is_unit(Item(*markers)) is unit


def config(workerid: str | None, count: int = 3):
    if workerid is None:
        return SimpleNamespace()
    return SimpleNamespace(workerinput={"workerid": workerid, "workercount": count,
                                        "testrunuid": "run1"})


def test_the_serial_worker_waits_until_every_other_worker_ended(tmp_path, monkeypatch):
    monkeypatch.setenv(xdist_tiers.RUN_ENV, "run1")
    waited = threading.Event()

    def wait():
        xdist_tiers.wait_for_other_workers(config("gw0"), tmp_path)
        waited.set()

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    xdist_tiers.mark_done(config("gw1"), tmp_path)
    time.sleep(1.5)
    assert not waited.is_set(), "returned with gw2 still running"
    xdist_tiers.mark_done(config("gw2"), tmp_path)
    assert waited.wait(5), "still waiting after every other worker ended"
    assert not list(tmp_path.iterdir()), "the done files are left behind"


def test_outside_xdist_nothing_waits_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv(xdist_tiers.RUN_ENV, "run1")
    xdist_tiers.mark_done(config(None), tmp_path)
    assert not list(tmp_path.iterdir())
    t0 = time.monotonic()
    xdist_tiers.wait_for_other_workers(config(None), tmp_path)
    assert time.monotonic() - t0 < 1


class Node:
    """A stand-in for xdist's WorkerController: records what it is sent to run."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices):
        self.sent.extend(indices)

    def send_runtest_all(self):
        raise AssertionError("scope scheduling sends chosen tests")

    def shutdown(self):
        self.shutting_down = True


def test_the_serial_tests_go_to_one_worker_in_session_order(tmp_path, monkeypatch):
    """The real xdist scheduler, fed the ids one worker wrote at collection: every serial test
    on one worker, in the session's order; the unit tests spread over both."""
    monkeypatch.setenv(xdist_tiers.RUN_ENV, "run1")
    units = [Item() for _ in range(6)]
    serial = [Item("engine"), Item("cluster"), Item("cluster"), Item("late")]
    items = [*units[:3], *serial, *units[3:]]
    for n, item in enumerate(items):
        item.nodeid = f"tests/test_{n}.py::test[{n}]"
    xdist_tiers.write_serial(tmp_path, items)
    ids = [i.nodeid for i in items]

    sched = xdist_tiers.SerialGroupScheduling(
        SimpleNamespace(getvalue=lambda k: ["2*popen"] if k == "tx" else None,
                        option=SimpleNamespace(loadscopereorder=True)), None, tmp_path)
    a, b = Node("gw0"), Node("gw1")
    for node in (a, b):
        sched.add_node(node)
        sched.add_node_collection(node, ids)
    sched.schedule()
    want = [ids.index(i.nodeid) for i in serial]
    got_serial = [x for x in (a.sent + b.sent) if x in want]
    holder = a if set(want) <= set(a.sent) else b
    assert set(want) <= set(holder.sent), (a.sent, b.sent)  # all on one worker
    assert [x for x in holder.sent if x in want] == want == got_serial  # in order, once
    other = b if holder is a else a
    assert other.sent and not set(other.sent) & set(want)
    assert not list(tmp_path.iterdir()), "the serial file is left behind"


def test_without_a_run_id_every_test_is_its_own_scope(tmp_path, monkeypatch):
    monkeypatch.delenv(xdist_tiers.RUN_ENV, raising=False)
    xdist_tiers.write_serial(tmp_path, [Item("cluster")])
    assert not list(tmp_path.iterdir())
    sched = xdist_tiers.SerialGroupScheduling(
        SimpleNamespace(getvalue=lambda k: ["2*popen"] if k == "tx" else None), None, tmp_path)
    assert sched._split_scope("tests/a.py::t") == "tests/a.py::t"
