"""Length-aware batching: bucket rules, order restoration, and the concurrent batcher."""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest

from embedfleet.deployments.request_path.batching import LengthAwareBatcher, length_buckets, restore_order

RATIO = 1.2


def mixed_lengths(n: int = 200, seed: int = 3) -> list[int]:
    rng = random.Random(seed)
    # Log-uniform 5..3,000 tokens, like the mixed batch.
    return [int(round(5 * (600 ** rng.random()))) for _ in range(n)]


def assert_within_ratio(lengths: list[int], ratio: float = RATIO) -> None:
    if len(lengths) > 1:
        assert max(lengths) <= ratio * min(lengths), f"batch lengths {sorted(lengths)} exceed ratio"


# -- pure functions ----------------------------------------------------------------------------
def test_buckets_cover_every_index_once_within_ratio_and_budgets():
    lengths = mixed_lengths()
    groups = length_buckets(lengths, RATIO, max_batch_tokens=8192, max_batch_size=16)
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(len(lengths)))
    for g in groups:
        assert_within_ratio([lengths[i] for i in g])
        assert len(g) <= 16
        assert len(g) == 1 or sum(lengths[i] for i in g) <= 8192
    # Grouping is real, not one input per group.
    assert len(groups) < len(lengths) / 3


def test_buckets_edge_cases():
    assert length_buckets([]) == []
    assert length_buckets([10, 10, 10], max_batch_size=2) == [[0, 1], [2]]
    assert length_buckets([100, 5000, 101], max_batch_tokens=1000) == [[0, 2], [1]]
    assert length_buckets([10, 12, 13], ratio=1.2) == [[0, 1], [2]]  # 13 > 1.2 * 10
    with pytest.raises(ValueError):
        length_buckets([1, 2], ratio=0.9)


def test_restore_order_round_trip_and_checks():
    lengths = mixed_lengths(50, seed=9)
    groups = length_buckets(lengths, RATIO, max_batch_size=8)
    outputs = [[f"v{i}" for i in g] for g in groups]
    assert restore_order(groups, outputs) == [f"v{i}" for i in range(50)]
    with pytest.raises(ValueError):
        restore_order([[0, 1], [1]], [["a", "b"], ["c"]])  # index twice
    with pytest.raises(ValueError):
        restore_order([[0, 1]], [["a"]])  # output missing


# -- the concurrent batcher --------------------------------------------------------------------
class FakeEngine:
    """Records each batch; a piece's vector encodes the piece, so order mix-ups are visible."""

    def __init__(self, delay_s: float = 0.0, fail_on: int | None = None) -> None:
        self.batches: list[list[list[int]]] = []
        self.dispatch_times: list[float] = []
        self.delay_s = delay_s
        self.fail_on = fail_on

    async def __call__(self, batch: list[list[int]]) -> list[np.ndarray]:
        self.batches.append([list(p) for p in batch])
        self.dispatch_times.append(time.monotonic())
        await asyncio.sleep(self.delay_s)
        if self.fail_on is not None and any(p[0] == self.fail_on for p in batch):
            raise RuntimeError("engine failed this batch")
        return [np.array([p[0], len(p)], dtype=np.float64) for p in batch]


def piece(tag: int, length: int) -> list[int]:
    return [tag] + [0] * (length - 1)


def check_outputs(pieces: list[list[int]], out: list[np.ndarray]) -> None:
    assert [(int(v[0]), int(v[1])) for v in out] == [(p[0], len(p)) for p in pieces]


def test_concurrent_callers_get_their_own_vectors_in_order_and_batches_stay_in_ratio():
    engine = FakeEngine(delay_s=0.001)
    lengths = mixed_lengths(200, seed=11)

    async def main():
        batcher = LengthAwareBatcher(engine, ratio=RATIO, max_batch_tokens=16384,
                                     max_batch_size=64, collect_ms=5)
        callers = []
        for c in range(10):  # 10 requests of 20 inputs each, unique tags
            callers.append([piece(c * 1000 + k, lengths[c * 20 + k]) for k in range(20)])
        outs = await asyncio.gather(*(batcher.embed(p) for p in callers))
        await batcher.close()
        return callers, outs

    callers, outs = asyncio.run(main())
    for pieces, out in zip(callers, outs):
        check_outputs(pieces, out)
    seen = sorted(p[0] for b in engine.batches for p in b)
    assert seen == sorted(p[0] for c in callers for p in c), "every piece embedded exactly once"
    for b in engine.batches:
        assert_within_ratio([len(p) for p in b])
    # Concurrent callers were merged: batches mix requests.
    assert any(len({p[0] // 1000 for p in b}) > 1 for b in engine.batches)


def test_callers_arriving_within_the_collect_window_share_one_batch():
    engine = FakeEngine()

    async def main():
        batcher = LengthAwareBatcher(engine, collect_ms=20)
        a = asyncio.create_task(batcher.embed([piece(1, 100)]))
        await asyncio.sleep(0.002)
        b = asyncio.create_task(batcher.embed([piece(2, 110)]))
        await asyncio.gather(a, b)
        await batcher.close()

    asyncio.run(main())
    assert [[p[0] for p in b] for b in engine.batches] == [[1, 2]]


def test_long_input_is_not_starved_by_a_stream_of_short_ones():
    """One engine slot, a 'fullest group first' picker, and a steady stream of short inputs: the
    long input must still go within max_wait_ms (plus one batch in flight), not after the stream."""
    engine = FakeEngine(delay_s=0.005)
    max_wait_ms = 40
    stream_s = 3.0

    async def main():
        batcher = LengthAwareBatcher(engine, collect_ms=1, max_wait_ms=max_wait_ms,
                                     max_inflight_batches=1, max_batch_size=32)
        stop = asyncio.Event()

        async def stream():
            k = 0
            while not stop.is_set():
                asyncio.ensure_future(batcher.embed([piece(10_000 + k + j, 20) for j in range(8)]))
                k += 8
                await asyncio.sleep(0.002)

        producer = asyncio.create_task(stream())
        await asyncio.sleep(0.02)
        t0 = time.monotonic()
        long_task = asyncio.create_task(batcher.embed([piece(1, 3000)]))
        out = await asyncio.wait_for(long_task, timeout=stream_s)
        stop.set()
        await producer
        await batcher.close()
        return t0, out

    t0, out = asyncio.run(main())
    check_outputs([piece(1, 3000)], out)
    k = next(i for i, b in enumerate(engine.batches) if b[0][0] == 1)
    waited = engine.dispatch_times[k] - t0
    # Bound: max_wait + one in-flight batch + scheduling slack on a busy 2-core box.
    assert waited < max_wait_ms / 1000 + 0.3, f"long input waited {waited:.3f}s"
    assert any(b[0][0] >= 10_000 for b in engine.batches[k + 1:]), "stream was still running"


def test_cancelled_caller_is_dropped_and_others_are_unaffected():
    engine = FakeEngine(delay_s=0.01)

    async def main():
        batcher = LengthAwareBatcher(engine, collect_ms=30, max_wait_ms=60)
        a = asyncio.create_task(batcher.embed([piece(1, 50), piece(2, 52)]))
        b = asyncio.create_task(batcher.embed([piece(3, 51), piece(4, 500)]))
        await asyncio.sleep(0.005)
        a.cancel()  # before dispatch: its pieces must never reach the engine
        out_b = await b
        with pytest.raises(asyncio.CancelledError):
            await a
        # Cancelled while in flight: the batch still completes for the other caller.
        c = asyncio.create_task(batcher.embed([piece(5, 50)]))
        d = asyncio.create_task(batcher.embed([piece(6, 50)]))
        while not engine.batches or engine.batches[-1][0][0] not in (5, 6):
            await asyncio.sleep(0.001)
        c.cancel()
        out_d = await d
        dropped = batcher.dropped_cancelled
        await batcher.close()
        return out_b, out_d, dropped

    out_b, out_d, dropped = asyncio.run(main())
    check_outputs([piece(3, 51), piece(4, 500)], out_b)
    check_outputs([piece(6, 50)], out_d)
    tags = [p[0] for b in engine.batches for p in b]
    assert 1 not in tags and 2 not in tags
    assert dropped == 2


def test_a_failing_batch_fails_only_its_callers():
    engine = FakeEngine(fail_on=7)

    async def main():
        batcher = LengthAwareBatcher(engine, collect_ms=10)
        bad = asyncio.create_task(batcher.embed([piece(7, 1000), piece(8, 20)]))
        good = asyncio.create_task(batcher.embed([piece(9, 21)]))
        results = await asyncio.gather(bad, good, return_exceptions=True)
        again = await batcher.embed([piece(10, 30)])  # the owner survived
        await batcher.close()
        return results, again

    (bad, good), again = asyncio.run(main())
    assert isinstance(bad, RuntimeError) and "engine failed" in str(bad)
    check_outputs([piece(9, 21)], good)
    check_outputs([piece(10, 30)], again)


def test_wrong_output_count_is_an_error_not_a_silent_misalignment():
    async def short_engine(batch):
        return [np.zeros(2)] * (len(batch) - 1)

    async def main():
        batcher = LengthAwareBatcher(short_engine, collect_ms=1)
        try:
            return await batcher.embed([piece(1, 10), piece(2, 10)])
        finally:
            await batcher.close()

    with pytest.raises(RuntimeError, match="1 outputs for 2 inputs"):
        asyncio.run(main())


def test_batcher_config_is_validated():
    with pytest.raises(ValueError, match="max_wait_ms"):
        LengthAwareBatcher(FakeEngine(), collect_ms=10, max_wait_ms=5)
    with pytest.raises(ValueError, match="ratio"):
        LengthAwareBatcher(FakeEngine(), ratio=0.5)
