"""AdmissionBudget: FIFO fairness, bounded waits with Retry-After, oversize-alone, run-time limit
changes, cancellation without leaks, and a randomized stress run that checks the limits hold."""

from __future__ import annotations

import asyncio
import random

import pytest

from embedfleet.deployments.replica.admission import (REJECT_QUEUE_FULL, REJECT_QUEUE_TIMEOUT, Admission,
                                AdmissionBudget)
from embedfleet.deployments.common.errors import Overloaded


def run(coro):
    return asyncio.run(coro)


async def settle() -> None:
    """Let every ready task run (grants resume their waiters on the next iterations)."""
    for _ in range(5):
        await asyncio.sleep(0)


class Holder:
    """Holds an admission open until ``release()``; records when it was admitted."""

    def __init__(self, budget: AdmissionBudget, seqs: int, tokens: int, log: list,
                 name: str, timeout_s: float | None = None) -> None:
        self.gate = asyncio.Event()
        self.admission: Admission | None = None
        self.task = asyncio.create_task(self._run(budget, seqs, tokens, log, name, timeout_s))

    async def _run(self, budget, seqs, tokens, log, name, timeout_s):
        async with budget.admit(seqs, tokens, timeout_s) as adm:
            self.admission = adm
            log.append(name)
            await self.gate.wait()

    def release(self) -> None:
        self.gate.set()


def test_fast_path_and_snapshot():
    async def main():
        b = AdmissionBudget(4, 100)
        async with b.admit(2, 60) as adm:
            assert adm == Admission(2, 60, 0.0, alone=False)
            snap = b.snapshot()
            assert (snap["inflight_sequences"], snap["inflight_tokens"]) == (2, 60)
            assert (snap["max_sequences"], snap["max_tokens"], snap["waiting"]) == (4, 100, 0)
        snap = b.snapshot()
        assert (snap["inflight_sequences"], snap["inflight_tokens"]) == (0, 0)
        assert snap["admitted_total"] == 1
    run(main())


def test_fifo_a_large_request_is_not_starved_by_a_stream_of_small_ones():
    async def main():
        b = AdmissionBudget(8, 10)
        log: list[str] = []
        first = Holder(b, 1, 8, log, "first")
        await settle()
        large = Holder(b, 1, 10, log, "large")  # needs the whole budget
        await settle()
        smalls = [Holder(b, 1, 1, log, f"small{i}") for i in range(5)]  # would fit beside first
        await settle()
        assert log == ["first"], "small requests overtook the queued large one"
        assert b.snapshot()["waiting"] == 6
        first.release()
        await settle()
        assert log == ["first", "large"]  # large goes next and fills the budget
        large.release()
        await settle()
        assert log == ["first", "large"] + [f"small{i}" for i in range(5)]  # then in order
        for h in smalls:
            h.release()
        await asyncio.gather(first.task, large.task, *(h.task for h in smalls))
        assert b.snapshot()["inflight_tokens"] == 0
    run(main())


def test_timeout_raises_overloaded_with_retry_after_from_queued_work():
    async def main():
        now = [0.0]
        b = AdmissionBudget(4, 10, clock=lambda: now[0])
        # Teach the budget that work holds it for 2 s on average.
        async with b.admit(1, 5):
            now[0] += 2.0
        assert b.snapshot()["mean_hold_s"] == pytest.approx(2.0)
        log: list[str] = []
        full = Holder(b, 1, 10, log, "full")
        await settle()
        with pytest.raises(Overloaded) as info:
            async with b.admit(1, 10, timeout_s=0.05):
                pytest.fail("admitted past a full budget")
        err = info.value
        # Ahead of it: 10 tokens in flight + its own 10 = two budgets' worth, 2 s each.
        assert err.status == 429 and err.retry_after_s == pytest.approx(4.0)
        assert err.headers() == {"Retry-After": "4"}
        assert "no batch budget" in err.message
        snap = b.snapshot()
        assert snap["waiting"] == 0 and snap["rejected"][REJECT_QUEUE_TIMEOUT] == 1
        full.release()
        await full.task
        assert b.snapshot()["inflight_tokens"] == 0
    run(main())


def test_retry_after_without_history_is_at_least_one_second_and_capped():
    b = AdmissionBudget(4, 10, max_retry_after_s=30)
    assert b.retry_after_s(1, 10, fallback_hold_s=0.05) == 1.0
    assert b.retry_after_s(1, 1000, fallback_hold_s=5.0) == 30.0


def test_full_queue_and_zero_timeout_refuse_at_once():
    async def main():
        reasons: list[str] = []
        b = AdmissionBudget(1, 10, max_waiting=1, on_reject=reasons.append)
        log: list[str] = []
        holder = Holder(b, 1, 10, log, "holder")
        await settle()
        with pytest.raises(Overloaded):  # no queueing allowed
            async with b.admit(1, 1, timeout_s=0):
                pass
        waiter = Holder(b, 1, 1, log, "waiter")
        await settle()
        with pytest.raises(Overloaded) as info:
            async with b.admit(1, 1):
                pass
        assert "queue full" in info.value.message and info.value.retry_after_s >= 1
        assert reasons == [REJECT_QUEUE_TIMEOUT, REJECT_QUEUE_FULL]
        holder.release()
        await settle()
        waiter.release()
        await asyncio.gather(holder.task, waiter.task)
        assert log == ["holder", "waiter"]
    run(main())


def test_oversize_request_runs_alone():
    async def main():
        b = AdmissionBudget(4, 10)
        log: list[str] = []
        # On an idle card it is admitted at once, flagged as alone.
        async with b.admit(1, 25) as adm:
            assert adm.alone and b.snapshot()["inflight_tokens"] == 25
        small = Holder(b, 1, 3, log, "small")
        await settle()
        big = Holder(b, 6, 25, log, "big")  # more sequences and tokens than the budget
        await settle()
        after = Holder(b, 1, 1, log, "after")
        await settle()
        assert log == ["small"]  # big waits for the card to empty
        small.release()
        await settle()
        assert log == ["small", "big"] and big.admission.alone
        snap = b.snapshot()
        assert (snap["inflight_sequences"], snap["inflight_tokens"]) == (6, 25)  # nothing beside
        big.release()
        await settle()
        assert log == ["small", "big", "after"]
        after.release()
        await asyncio.gather(small.task, big.task, after.task)
        assert b.snapshot()["oversize_total"] == 2
    run(main())


def test_lowering_limits_keeps_admitted_work_and_raising_wakes_waiters():
    async def main():
        b = AdmissionBudget(8, 10)
        log: list[str] = []
        a = Holder(b, 1, 8, log, "a")
        await settle()
        b.set_limits(2, 4)  # lower below what is in flight: nothing is cancelled
        assert not a.task.done() and b.snapshot()["inflight_tokens"] == 8
        c = Holder(b, 1, 2, log, "c")
        await settle()
        assert log == ["a"]
        b.set_limits(8, 20)  # raise: the waiter goes in at once
        await settle()
        assert log == ["a", "c"]
        b.set_limits(1, 1)
        d = Holder(b, 1, 1, log, "d")
        await settle()
        a.release()
        await settle()
        assert log == ["a", "c"]  # still 2 tokens in flight > new limit 1
        c.release()
        await settle()
        assert log == ["a", "c", "d"]
        d.release()
        await asyncio.gather(a.task, c.task, d.task)
        with pytest.raises(ValueError):
            b.set_limits(0, 10)
    run(main())


def test_cancelled_waiter_leaves_the_queue_without_leaking_budget():
    async def main():
        b = AdmissionBudget(4, 10)
        log: list[str] = []
        holder = Holder(b, 1, 10, log, "holder")
        await settle()
        gone = Holder(b, 1, 10, log, "gone")  # head of the queue, client goes away
        behind = Holder(b, 1, 4, log, "behind")
        await settle()
        gone.task.cancel()
        await settle()
        snap = b.snapshot()
        assert snap["waiting"] == 1 and snap["waiting_tokens"] == 4
        assert snap["cancelled_total"] == 1
        holder.release()
        await settle()
        assert log == ["holder", "behind"]  # the cancelled head did not block it
        behind.release()
        await asyncio.gather(holder.task, behind.task)
        with pytest.raises(asyncio.CancelledError):
            await gone.task
        snap = b.snapshot()
        assert (snap["inflight_sequences"], snap["inflight_tokens"], snap["waiting"]) == (0, 0, 0)
    run(main())


def test_cancel_right_after_the_grant_gives_the_budget_back():
    async def main():
        b = AdmissionBudget(4, 10)
        log: list[str] = []
        holder = Holder(b, 1, 10, log, "holder")
        await settle()
        waiter = Holder(b, 1, 5, log, "waiter")
        await settle()
        b.set_limits(4, 20)  # grants the waiter synchronously ...
        waiter.task.cancel()  # ... and its client goes away before it resumes
        with pytest.raises(asyncio.CancelledError):
            await waiter.task
        assert log == ["holder"] and b.snapshot()["inflight_tokens"] == 10
        holder.release()
        await holder.task
        assert b.snapshot()["inflight_tokens"] == 0
    run(main())


def test_cancelling_the_body_releases():
    async def main():
        b = AdmissionBudget(4, 10)
        log: list[str] = []
        h = Holder(b, 2, 7, log, "h")
        await settle()
        h.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await h.task
        assert b.snapshot()["inflight_tokens"] == 0
    run(main())


class CheckedBudget(AdmissionBudget):
    """Asserts the budget invariant at every grant, against the limits at that moment."""

    violations: list[str]

    def _take(self, n_seqs, n_tokens, lane, in_window, runs=False):
        adm = super()._take(n_seqs, n_tokens, lane, in_window, runs)
        if not 0 <= self._run_seqs <= self._inflight_seqs:
            self.violations.append(f"{self._run_seqs} sequences in runs of {self._inflight_seqs}")
        seqs, toks = self._inflight_seqs, self._inflight_tokens
        within = seqs <= self._max_seqs and toks <= self._max_tokens
        alone = (seqs, toks) == (n_seqs, n_tokens)
        if not (within or alone):
            self.violations.append(f"{seqs}/{toks} > {self.limits} granting {n_seqs}/{n_tokens}")
        share = self._bulk_inflight_share
        bulk_within = (self._bulk_seqs <= share * self._max_seqs
                       and self._bulk_tokens <= share * self._max_tokens)
        only_bulk = (self._bulk_seqs, self._bulk_tokens) == (n_seqs, n_tokens)
        if lane == "bulk" and not (bulk_within or alone or only_bulk):
            self.violations.append(f"bulk {self._bulk_seqs}/{self._bulk_tokens} over its share of "
                                   f"{self.limits} granting {n_seqs}/{n_tokens}")
        return adm


def test_stress_random_sizes_limit_changes_and_cancellations():
    async def main():
        rng = random.Random(4)
        b = CheckedBudget(16, 2048, max_waiting=10_000, queue_timeout_s=60)
        b.violations = []
        done: list[int] = []
        peak = [0, 0]

        async def client(i: int) -> None:
            seqs = rng.randint(1, 8)
            tokens = rng.choice([rng.randint(1, 600), rng.randint(1, 600), 3000])  # some oversize
            lane = rng.choice(["interactive", "interactive", "bulk"])
            runs = lane == "interactive" and rng.random() < 0.3  # a large call's run
            await asyncio.sleep(rng.random() * 0.05)
            async with b.admit(seqs, tokens, lane=lane, runs=runs, follows=runs):
                snap = b.snapshot()
                peak[0] = max(peak[0], snap["inflight_sequences"])
                peak[1] = max(peak[1], snap["inflight_tokens"])
                await asyncio.sleep(rng.random() * 0.004)
            done.append(i)

        async def governor() -> None:
            for _ in range(40):
                await asyncio.sleep(0.003)
                b.set_limits(rng.randint(1, 16), rng.randint(64, 2048))
            b.set_limits(16, 2048)

        tasks = [asyncio.create_task(client(i)) for i in range(400)]
        doomed = rng.sample(tasks, 40)
        gov = asyncio.create_task(governor())
        await asyncio.sleep(0.02)
        for t in doomed:
            t.cancel()
        results = await asyncio.gather(*tasks, gov, return_exceptions=True)
        cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
        others = [r for r in results if isinstance(r, BaseException)
                  and not isinstance(r, asyncio.CancelledError)]
        assert others == []
        assert len(done) + cancelled == 400 and cancelled <= 40
        assert b.violations == []
        snap = b.snapshot()
        assert (snap["inflight_sequences"], snap["inflight_tokens"], b._run_seqs) == (0, 0, 0)
        assert (snap["waiting"], snap["waiting_sequences"], snap["waiting_tokens"]) == (0, 0, 0)
        assert peak[1] > 0
    run(main())
