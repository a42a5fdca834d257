"""The owner queue's two lanes: interactive ahead of bulk, bulk capped in flight and in the queue,
and a guaranteed minimum share for bulk while both lanes wait (replica/admission.py)."""

from __future__ import annotations

import asyncio

import pytest

from embedfleet.deployments.common.errors import Overloaded
from embedfleet.deployments.replica.admission import (
    REJECT_BULK_QUEUE_FULL,
    REJECT_QUEUE_TIMEOUT,
    AdmissionBudget,
)


async def _hold(budget: AdmissionBudget, lane: str, release: asyncio.Event, seqs: int = 1,
                tokens: int = 10, log: list[str] | None = None, tag: str = "") -> None:
    async with budget.admit(seqs, tokens, lane=lane):
        if log is not None:
            log.append(tag or lane)
        await release.wait()


def test_an_interactive_call_starts_at_once_during_a_bulk_flood():
    async def main():
        b = AdmissionBudget(4, 1000, max_waiting=100, bulk_max_inflight_share=0.75)
        release = asyncio.Event()
        bulk = [asyncio.create_task(_hold(b, "bulk", release)) for _ in range(20)]
        await asyncio.sleep(0.01)
        snap = b.snapshot()
        # bulk holds 3 of 4 sequences (0.75), the rest of the flood waits
        assert snap["inflight_bulk_sequences"] == 3 and snap["waiting_bulk"] == 17
        got = []
        interactive = asyncio.create_task(_hold(b, "interactive", release, log=got))
        await asyncio.sleep(0.01)
        assert got == ["interactive"]  # admitted without waiting for any bulk call to end
        release.set()
        await asyncio.gather(*bulk, interactive)
        assert b.snapshot()["admitted_bulk_total"] == 20

    asyncio.run(main())


def test_waiting_interactive_calls_go_before_bulk_calls_that_arrived_earlier():
    async def main():
        b = AdmissionBudget(1, 1000, max_waiting=100, bulk_min_share=0.0)
        first = asyncio.Event()
        order: list[str] = []
        running = asyncio.create_task(_hold(b, "interactive", first))
        await asyncio.sleep(0)
        done = asyncio.Event()
        done.set()
        waiting = [asyncio.create_task(_hold(b, "bulk", done, log=order, tag=f"b{i}"))
                   for i in range(3)]
        await asyncio.sleep(0)
        waiting += [asyncio.create_task(_hold(b, "interactive", done, log=order, tag=f"i{i}"))
                    for i in range(3)]
        await asyncio.sleep(0.01)
        first.set()
        await asyncio.gather(running, *waiting)
        assert order == ["i0", "i1", "i2", "b0", "b1", "b2"]

    asyncio.run(main())


def _contended_run(min_share: float) -> tuple[int, int]:
    """Both lanes keep a backlog on a one-sequence budget; (interactive, bulk) admissions."""
    async def main():
        b = AdmissionBudget(1, 1000, max_waiting=1000, bulk_min_share=min_share)
        done = asyncio.Event()
        done.set()
        counts = {"interactive": 0, "bulk": 0}
        stop = asyncio.Event()

        async def client(lane: str) -> None:
            while not stop.is_set():
                async with b.admit(1, 10, lane=lane):
                    counts[lane] += 1
                    await asyncio.sleep(0.001)

        tasks = [asyncio.create_task(client(lane)) for lane in ["interactive"] * 8 + ["bulk"] * 8]
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*tasks)
        return counts["interactive"], counts["bulk"]

    return asyncio.run(main())


def test_bulk_gets_its_minimum_share_while_interactive_keeps_a_backlog():
    interactive, bulk = _contended_run(0.25)
    assert interactive > 20, (interactive, bulk)
    assert 0.2 <= bulk / (interactive + bulk) <= 0.35, (interactive, bulk)
    # ...and the share is what gives it: without it, a steady interactive backlog starves bulk
    interactive, bulk = _contended_run(0.0)
    assert bulk <= 8 and interactive > 20, (interactive, bulk)  # only before the backlog formed


def test_bulk_past_its_waiting_slots_gets_429_and_interactive_still_queues():
    async def main():
        b = AdmissionBudget(1, 1000, max_waiting=10, bulk_max_waiting=4)
        release = asyncio.Event()
        tasks = [asyncio.create_task(_hold(b, "interactive", release))]
        tasks += [asyncio.create_task(_hold(b, "bulk", release)) for _ in range(4)]
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded) as refused:
            async with b.admit(1, 10, lane="bulk"):
                pass
        assert refused.value.retry_after_s >= 1
        assert "bulk lane is full" in str(refused.value)
        tasks += [asyncio.create_task(_hold(b, "interactive", release)) for _ in range(5)]
        await asyncio.sleep(0.01)
        snap = b.snapshot()
        assert snap["waiting"] == 9 and snap["waiting_bulk"] == 4
        assert snap["rejected"][REJECT_BULK_QUEUE_FULL] == 1
        release.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())


def test_bulk_that_waits_past_its_bound_gets_429():
    async def main():
        b = AdmissionBudget(1, 1000, max_waiting=10, queue_timeout_s=0.05)
        release = asyncio.Event()
        holder = asyncio.create_task(_hold(b, "interactive", release))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):
            async with b.admit(1, 10, lane="bulk"):
                pass
        assert b.snapshot()["rejected"][REJECT_QUEUE_TIMEOUT] == 1
        release.set()
        await holder

    asyncio.run(main())


def test_bulk_alone_on_an_idle_card_runs_even_when_its_share_is_less_than_one_call():
    async def main():
        b = AdmissionBudget(1, 1000, max_waiting=10)  # 0.75 of 1 sequence
        async with b.admit(1, 10, lane="bulk") as adm:
            assert adm.waited_s == 0.0
        assert b.snapshot()["admitted_bulk_total"] == 1

    asyncio.run(main())


def test_a_bulk_call_held_back_by_its_cap_lets_waiting_interactive_calls_by():
    # Review finding: bulk owed its share but capped used to stop the queue, so interactive
    # calls that fit waited for a bulk call to end.
    async def main():
        b = AdmissionBudget(4, 1000, max_waiting=100, bulk_max_inflight_share=0.5,
                            bulk_min_share=0.5)
        bulk_done = asyncio.Event()
        ends = [asyncio.Event() for _ in range(4)]
        got: list[str] = []
        tasks = [asyncio.create_task(_hold(b, "bulk", bulk_done)) for _ in range(2)]
        tasks += [asyncio.create_task(_hold(b, "interactive", ends[k])) for k in range(2)]
        await asyncio.sleep(0.01)  # full: 2 bulk (its cap) + 2 interactive
        tasks.append(asyncio.create_task(_hold(b, "bulk", bulk_done, log=got, tag="b3")))
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(_hold(b, "interactive", ends[k], log=got, tag=f"i{k}"))
                  for k in (2, 3)]
        await asyncio.sleep(0.01)
        ends[0].set()  # a slot frees: i2 goes (interactive first), bulk is now owed its share
        await asyncio.sleep(0.01)
        ends[1].set()  # another: b3 is owed but capped, so i3 takes it instead of waiting
        await asyncio.sleep(0.01)
        assert got == ["i2", "i3"], (got, b.snapshot())
        assert b.snapshot()["waiting_bulk"] == 1
        for e in ends:
            e.set()
        bulk_done.set()
        await asyncio.gather(*tasks)
        assert got[-1] == "b3"

    asyncio.run(main())


def test_one_bulk_call_bigger_than_its_cap_runs_beside_interactive_work():
    async def main():
        b = AdmissionBudget(4, 1000, max_waiting=100, bulk_max_inflight_share=0.5)
        release = asyncio.Event()
        busy = asyncio.create_task(_hold(b, "interactive", release))
        await asyncio.sleep(0)
        got: list[str] = []
        big = asyncio.create_task(_hold(b, "bulk", release, seqs=3, log=got))
        await asyncio.sleep(0.01)
        assert got == ["bulk"]  # 3 > 0.5 x 4, but it is the only bulk call: no idle card needed
        release.set()
        await asyncio.gather(busy, big)

    asyncio.run(main())


def test_interactive_calls_that_never_queue_still_leave_bulk_its_share():
    # Review finding: interactive calls on the fast path took every freed slot, so a waiting
    # bulk call was refused at its timeout although interactive never built a queue.
    async def main():
        b = AdmissionBudget(4, 1000, max_waiting=100, queue_timeout_s=1.0,
                            bulk_max_inflight_share=0.75)
        stop = asyncio.Event()

        async def interactive() -> None:
            while not stop.is_set():
                async with b.admit(1, 10, lane="interactive"):
                    await asyncio.sleep(0.005)

        clients = [asyncio.create_task(interactive()) for _ in range(4)]
        await asyncio.sleep(0.05)
        async with b.admit(3, 30, lane="bulk") as adm:  # would time out if starved
            assert adm.waited_s < 1.0
        stop.set()
        await asyncio.gather(*clients)
        assert b.snapshot()["rejected"][REJECT_QUEUE_TIMEOUT] == 0

    asyncio.run(main())
