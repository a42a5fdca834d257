"""A bulk call reaches the engine in runs no larger than what bulk may hold in flight now
(``RequestPath._run_end``, ``AdmissionBudget.bulk_token_cap``), so a query arriving during a
bulk flood waits for a drain-sized step, not for a whole bulk call. Fakes stand in for the
tokenizer and vLLM only; the admission budget is the real one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from embedfleet.deployments.common.contracts import EmbedCall
from embedfleet.deployments.engine.vllm_engine import Embedding
from embedfleet.deployments.replica.admission import INTERACTIVE_RECENT_S, AdmissionBudget
from embedfleet.deployments.replica.request_path import RequestPath
from tests.support.admission_clock import Clock, measure
from tests.support.request_path_standins import gate_of, request_path_over


class RecordingEngine:
    """Each piece's vector is its first token id, so the order of the result is checkable; records
    the runs it gets and the most bulk tokens it held at once."""

    def __init__(self, budget: AdmissionBudget) -> None:
        self.runs: list[list[list[int]]] = []
        self.info = SimpleNamespace(prefix_caching=False)
        self._budget = budget
        self.max_bulk_tokens = 0

    async def embed(self, pieces, *, request_id, skip_prefix_cache, normalize, priority):
        self.runs.append(pieces)
        self.max_bulk_tokens = max(self.max_bulk_tokens, self._budget._bulk_tokens)
        await asyncio.sleep(0.001)
        return [Embedding(np.full(2, float(p[0]), np.float32), len(p), 0) for p in pieces]


def make_path(budget: AdmissionBudget, pieces: list[list[int]]) -> tuple[RequestPath,
                                                                         RecordingEngine]:
    engine = RecordingEngine(budget)
    return request_path_over(lambda: engine, budget, pieces), engine


def budget_with_cap(tokens_per_s: float, drain_s: float, **kw) -> AdmissionBudget:
    """A budget whose card was seen draining ``tokens_per_s`` under bulk work, with a query just
    now: bulk's cap is ``tokens_per_s * drain_s`` (below its share of the 4096-token budget).
    Its clock stands still (``budget._clock``), so the measured peak does not age."""
    clock = Clock()
    budget = AdmissionBudget(256, 4096, bulk_max_drain_s=drain_s, clock=clock, **kw)
    asyncio.run(measure(budget, clock, tokens_per_s, 1.0))
    return budget


def pieces_of(n: int, tokens: int) -> list[list[int]]:
    return [[k + 1] * tokens for k in range(n)]


def test_a_bulk_call_runs_in_drain_sized_runs_and_keeps_its_order():
    budget = budget_with_cap(tokens_per_s=1000, drain_s=0.05)  # cap: 50 tokens
    path, engine = make_path(budget, pieces_of(32, 10))
    out = asyncio.run(path.embed(EmbedCall(["x"] * 32, "req", "m", lane="bulk")))
    assert [len(r) for r in engine.runs] == [5] * 6 + [2]  # 50 tokens a run, the rest last
    assert engine.max_bulk_tokens <= 50
    assert out.vectors[:, 0].tolist() == [float(k + 1) for k in range(32)]  # input order
    assert budget._bulk_tokens == 0 and budget._inflight_tokens == 0  # every run released


def test_an_interactive_call_is_one_engine_call():
    budget = budget_with_cap(tokens_per_s=1000, drain_s=0.05)
    path, engine = make_path(budget, pieces_of(32, 10))
    asyncio.run(path.embed(EmbedCall(["x"] * 32, "req", "m", lane="interactive")))
    assert [len(r) for r in engine.runs] == [32]


def test_a_piece_larger_than_the_cap_runs_alone_and_whole():
    budget = budget_with_cap(tokens_per_s=1000, drain_s=0.05)
    pieces = [[1] * 10, [2] * 120, [3] * 10, [4] * 10]
    path, engine = make_path(budget, pieces)
    out = asyncio.run(path.embed(EmbedCall(["x"] * 4, "req", "m", lane="bulk")))
    assert [[p[0] for p in r] for r in engine.runs] == [[1], [2], [3, 4]]
    assert out.vectors[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("seen_query", [False, True])
def test_without_recent_queries_bulk_keeps_its_whole_share(seen_query):
    """Bulk alone runs in runs as large as its share (0.75 of 4096 tokens): solo throughput is
    not cut into small steps; the drain cap holds only while queries come."""
    budget = budget_with_cap(tokens_per_s=1000, drain_s=0.05)
    if not seen_query:
        budget._clock.t += INTERACTIVE_RECENT_S + 1
    path, engine = make_path(budget, pieces_of(64, 10))
    asyncio.run(path.embed(EmbedCall(["x"] * 64, "req", "m", lane="bulk")))
    assert len(engine.runs) == (13 if seen_query else 1)


def test_a_query_arriving_during_a_bulk_call_goes_between_its_runs():
    """Two bulk calls and a query: the query is admitted while bulk runs are in flight, and no
    engine call ever holds more bulk than the cap."""
    budget = budget_with_cap(tokens_per_s=1000, drain_s=0.05)
    engine = RecordingEngine(budget)
    bulk_a, _ = make_path(budget, pieces_of(20, 10))
    bulk_b, _ = make_path(budget, pieces_of(20, 10))
    query, _ = make_path(budget, [[99]])
    for p in (bulk_a, bulk_b, query):
        p.__dict__["_gate"] = gate_of(lambda: engine)

    async def scenario():
        a = asyncio.create_task(bulk_a.embed(EmbedCall(["x"] * 20, "a", "m", lane="bulk")))
        b = asyncio.create_task(bulk_b.embed(EmbedCall(["x"] * 20, "b", "m", lane="bulk")))
        await asyncio.sleep(0.002)
        await query.embed(EmbedCall(["q"], "q", "m", lane="interactive"))
        done_when_query_returned = a.done() and b.done()
        await asyncio.gather(a, b)
        return done_when_query_returned

    assert asyncio.run(scenario()) is False  # the query did not wait for the bulk calls
    assert [r for r in engine.runs if r == [[99]]]
    assert engine.max_bulk_tokens <= 50


def test_a_run_stays_within_bulks_sequence_share():
    """Runs of short texts end at bulk's sequence share (0.75 of 8), so no run is oversize."""
    budget = AdmissionBudget(8, 4096)  # no drain cap: the token share (3072) does not bind
    path, engine = make_path(budget, pieces_of(20, 2))
    out = asyncio.run(path.embed(EmbedCall(["x"] * 20, "req", "m", lane="bulk")))
    assert [len(r) for r in engine.runs] == [6, 6, 6, 2]
    assert budget.snapshot()["oversize_total"] == 0
    assert out.vectors[:, 0].tolist() == [float(k + 1) for k in range(20)]


def test_a_calls_later_runs_are_not_refused_by_the_waiting_limits():
    """The bulk lane holds one waiting call (bulk_max_waiting=1), and a second call is refused;
    the first call's later runs queue past that limit, at the head of the lane: work already
    done is not thrown away by a 429."""
    from embedfleet.deployments.common.errors import Overloaded

    budget = budget_with_cap(1000, 0.05, max_waiting=2, bulk_max_waiting=1)  # 5 pieces a run
    first, engine = make_path(budget, pieces_of(20, 10))
    second, _ = make_path(budget, pieces_of(20, 10))
    third, _ = make_path(budget, pieces_of(20, 10))

    async def scenario():
        a = asyncio.create_task(first.embed(EmbedCall(["x"] * 20, "a", "m", lane="bulk")))
        await asyncio.sleep(0)  # a's first run is in flight
        b = asyncio.create_task(second.embed(EmbedCall(["x"] * 20, "b", "m", lane="bulk")))
        await asyncio.sleep(0)  # b waits: the lane's one waiting slot
        with pytest.raises(Overloaded):
            await third.embed(EmbedCall(["x"] * 20, "c", "m", lane="bulk"))
        return await asyncio.gather(a, b)

    a, b = asyncio.run(scenario())
    assert a.vectors.shape == b.vectors.shape == (20, 2)
    assert budget.snapshot()["rejected"]["bulk_queue_full"] == 1  # the third call only


def test_an_engine_swap_between_runs_sends_the_whole_call_again():
    """One call's vectors come from one engine: when the gate hands a later run a new engine
    (prefix caching switched), every run goes again on the new one."""
    budget = budget_with_cap(tokens_per_s=1000, drain_s=0.05)
    old, new = RecordingEngine(budget), RecordingEngine(budget)
    path, _ = make_path(budget, pieces_of(12, 10))
    handed = iter([old, new, new, new, new, new])
    path.__dict__["_gate"] = gate_of(lambda: next(handed))
    out = asyncio.run(path.embed(EmbedCall(["x"] * 12, "req", "m", lane="bulk")))
    assert [len(r) for r in old.runs] == [5]
    assert [len(r) for r in new.runs] == [5, 2, 5, 5, 2]  # the rest, then the call again
    assert out.vectors[:, 0].tolist() == [float(k + 1) for k in range(12)]
