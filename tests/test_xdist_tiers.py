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


def test_the_serial_worker_waits_until_every_other_worker_ended(tmp_path):
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


def test_outside_xdist_nothing_waits_and_nothing_is_written(tmp_path):
    xdist_tiers.mark_done(config(None), tmp_path)
    assert not list(tmp_path.iterdir())
    t0 = time.monotonic()
    xdist_tiers.wait_for_other_workers(config(None), tmp_path)
    assert time.monotonic() - t0 < 1
