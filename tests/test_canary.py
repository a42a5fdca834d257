"""The prefix-cache canary's calibrated floor and verdicts, on a STAND-IN engine (no vLLM).

``HitPathStandIn`` embeds token ids to a fixed vector per input; a call that may read the cache
and repeats ids it has seen reports cached tokens, and its vector is turned away from the cold
one by exactly a chosen cosine (the card's hit path in bf16, or a corrupting one). Its cold path
can be given noise of its own (a nondeterministic card). The controller, the canary and the
verdict logic are the real ones.
"""

from __future__ import annotations

import asyncio
import hashlib

from types import SimpleNamespace

import numpy as np
import pytest

from embedfleet.deployments.common import metrics
from embedfleet.deployments.common.contracts import CanaryView
from embedfleet.deployments.replica import canary
from embedfleet.deployments.replica.prefix_cache import PrefixCacheController
from embedfleet.deployments.engine.gate import EngineGate
from embedfleet.deployments.engine.vllm_engine import Embedding

DIM = 64


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def _turned(v: np.ndarray, cosine: float, seed: int) -> np.ndarray:
    """A unit vector at exactly ``cosine`` to unit ``v``."""
    other = np.random.default_rng(seed).standard_normal(v.shape)
    other = _unit(other - np.dot(other, v) * v)
    return cosine * v + np.sqrt(max(0.0, 1.0 - cosine * cosine)) * other


class HitPathStandIn:
    """STAND-IN engine: cache hits come back at ``hit_cosine`` to the cold vector; cold runs at
    ``cold_cosine`` to each other (1.0: deterministic)."""

    def __init__(self, hit_cosine: float, cold_cosine: float = 1.0) -> None:
        self.hit_cosine = hit_cosine
        self.cold_cosine = cold_cosine
        self.seen: set[tuple[int, ...]] = set()
        self.cold_calls = 0
        self.shut = False
        self.info = SimpleNamespace(prefix_caching=True)  # an engine that caches prefixes

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [[b for b in t.encode()] for t in texts]

    def _truth(self, ids: list[int]) -> np.ndarray:
        seed = int.from_bytes(hashlib.sha256(bytes(i % 256 for i in ids)).digest()[:8], "little")
        return _unit(np.random.default_rng(seed).standard_normal(DIM))

    async def embed(self, token_ids, *, request_id, dimensions=None, skip_prefix_cache=False,
                    normalize=True, priority=0):
        out = []
        cold_run = skip_prefix_cache or not any(tuple(i[:400]) in self.seen for i in token_ids)
        self.cold_calls += cold_run  # every other cold call is off by cold_cosine
        for ids in token_ids:
            key = tuple(ids[:400])  # the shared prefix: the probes' first 400 bytes
            truth = self._truth(ids)
            if not skip_prefix_cache and key in self.seen:
                vec, cached = _turned(truth, self.hit_cosine, len(ids)), 384
            else:
                vec = truth if self.cold_calls % 2 else _turned(truth, self.cold_cosine, 7)
                cached = 0
            self.seen.add(key)
            out.append(Embedding(vec.astype(np.float64), len(ids), cached))
        return out

    def shutdown(self) -> None:
        self.shut = True


class Gauges:
    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple], float] = {}

    def get(self, name: str):
        recorder = self

        class _Metric:
            def set(self, value, tags=None):
                recorder.values[(name, tuple(sorted((tags or {}).items())))] = value

            def inc(self, value=1, tags=None):
                key = (name, tuple(sorted((tags or {}).items())))
                recorder.values[key] = recorder.values.get(key, 0) + value

        assert name in metrics.BY_NAME, name  # only metrics the module declares
        return _Metric()


@pytest.fixture
def gauges(monkeypatch) -> Gauges:
    g = Gauges()
    monkeypatch.setattr(metrics, "get", g.get)
    return g


def _controller(engine, reported: list, built: list) -> PrefixCacheController:
    async def report(reason, view):
        reported.append((reason, view))

    def build(prefix_cache):
        built.append(prefix_cache)
        return HitPathStandIn(1.0)

    async def no_sleep(_s):
        return None

    return PrefixCacheController(
        model="m", card_label="n/0", enabled=True, reason="policy", gate=EngineGate(engine),
        build_engine=build, shutdown_engine=lambda e: e.shutdown(), report_failure=report,
        canary_interval_s=3600, sleep=no_sleep)


def test_floor_is_the_tighter_of_the_spread_and_vllm_ascends_tolerance_within_bounds():
    assert canary.floor_from_spread(1.0) == canary.STRICT_FLOOR  # deterministic path
    assert canary.floor_from_spread(0.9999) == pytest.approx(0.999)  # 10 x the spread
    assert canary.floor_from_spread(0.9) == canary.FAIL_COSINE  # never looser than 1e-2
    assert canary.floor_from_spread(1.0 + 1e-7) == canary.STRICT_FLOOR  # rounding above 1
    assert (canary.FAIL_COSINE, canary.STRICT_FLOOR) == (0.99, 0.99999)


@pytest.mark.parametrize("cosine, cached, floor, verdict", [
    (0.999995, 384, 0.99999, "passed"),
    (0.995, 384, 0.99999, "inconclusive"),   # between 0.99 and the floor
    (0.995, 384, 0.99, "passed"),            # a noisy path's calibrated floor
    (0.9899, 384, 0.99, "failed"),
    (0.58, 384, 0.99999, "failed"),          # the corruption it guards against
    (1.0, 0, 0.99999, "inconclusive"),       # no cache hit: nothing proven
    (0.58, 0, 0.99999, "inconclusive"),
])
def test_judge(cosine, cached, floor, verdict):
    assert canary.judge(cosine, cached, floor) == verdict


def test_hit_path_off_by_0995_is_inconclusive_and_caching_stays_on(gauges):
    reported: list = []
    built: list = []
    engine = HitPathStandIn(hit_cosine=0.995)
    ctl = _controller(engine, reported, built)

    async def scenario():
        await ctl.prove()
        await asyncio.sleep(0)  # a swap task, had one been started, would run now
        return await ctl.canary_once()

    again = asyncio.run(scenario())
    last = ctl.last_canary
    assert last is not None and last.verdict == "inconclusive", last
    assert again.verdict == "inconclusive"
    assert last.min_cosine == pytest.approx(0.995, abs=1e-6) and last.cached_tokens > 0
    assert last.floor == canary.STRICT_FLOOR  # the stand-in's cold path is deterministic
    assert "inconclusive" in last.detail and "0.99" in last.detail
    # Caching stays on: no switch, no swap, nothing reported to the registry.
    assert ctl.state == "on" and ctl.reads_cache and ctl._swap_task is None
    assert reported == [] and built == [] and not engine.shut
    # /v1/models shows the last cosine and the floor in use; so do the gauges.
    view = ctl.view().last_canary
    assert view.verdict == "inconclusive" and not view.passed and not view.conclusive
    assert view.floor == canary.STRICT_FLOOR and view.min_cosine == pytest.approx(0.995, abs=1e-6)
    tag = (("model", "m"),)
    assert gauges.values[("embedfleet_canary_floor", tag)] == canary.STRICT_FLOOR
    assert gauges.values[("embedfleet_canary_last_cosine", tag)] == pytest.approx(0.995, abs=1e-6)
    assert gauges.values[("embedfleet_prefix_cache_enabled", tag)] == 1
    assert gauges.values[("embedfleet_canary_inconclusive_total", tag)] == 1 + 4  # reruns
    assert ("embedfleet_canary_failures_total", tag) not in gauges.values


def test_a_noisy_cold_path_calibrates_a_looser_floor_and_its_hits_pass(gauges):
    # Two cold runs agree to 0.9999: the floor is 0.999, and a hit at 0.9995 passes.
    engine = HitPathStandIn(hit_cosine=0.9995, cold_cosine=0.9999)
    ctl = _controller(engine, [], [])
    asyncio.run(ctl.prove())
    assert ctl.floor is not None
    assert ctl.floor.cold_min_cosine == pytest.approx(0.9999, abs=1e-7)
    assert ctl.floor.floor == pytest.approx(0.999, abs=1e-6)
    assert ctl.last_canary.verdict == "passed" and ctl.last_canary.floor == ctl.floor.floor
    assert ctl.state == "on"


def test_below_099_fails_and_switches_caching_off_fleet_wide(gauges):
    reported: list = []
    built: list = []
    engine = HitPathStandIn(hit_cosine=0.98)
    ctl = _controller(engine, reported, built)

    async def scenario():
        await ctl.prove()
        await ctl._swap_task

    asyncio.run(scenario())
    assert ctl.last_canary.verdict == "failed"
    assert ctl.state == "off" and not ctl.reads_cache
    assert built == [False] and engine.shut  # swapped to an engine without prefix caching
    assert len(reported) == 1 and isinstance(reported[0][1], CanaryView)
    assert reported[0][1].floor == canary.STRICT_FLOOR


def test_a_canary_view_recorded_before_floors_still_reads():
    old = {"verdict": "failed", "passed": False, "conclusive": True, "min_cosine": 0.58,
           "cached_tokens": 100, "prefix_tokens": 300, "probes": 4, "at": 1.0, "detail": "x"}
    assert CanaryView.model_validate(old).floor is None
