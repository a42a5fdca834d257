"""EngineReplica's build step, its idle-floor check, and the direct ingress that holds one.

No engine runs here: ``build`` needs none (it makes the parts from the config sections), the
idle-floor check reads a stand-in card reading, and the direct ingress's calls go to a stand-in
replica that records them.
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from embedfleet.deployments.common.contracts import EmbedCall
from embedfleet.deployments.common.errors import EngineUnavailable, Overloaded
from embedfleet.deployments.config.schema import load_config, parse_config
from embedfleet.deployments.engine.card_profile import load_profile, shipped_profile_path
from embedfleet.deployments.engine.platform import CardIdentity
from embedfleet.deployments.ingress.direct import DirectEngine
from embedfleet.deployments.replica.engine_replica import EngineReplica

MODEL = "replica-parts-m"  # no card profile anywhere: the configured band applies
ASCEND_8B = "deployments/configs/ascend-910b-qwen3-embedding-8b.yaml"  # names its profile


def _config(**model):
    return parse_config({"models": [{"name": MODEL, "source": {"path": "/m"}, **model}]})


def _rejections(recorder) -> list[tuple[dict[str, str], float]]:
    return [(dict(tags), n) for (name, tags), n in recorder._counts.items()
            if name == "embedfleet_overload_rejections_total"]


# -- build ---------------------------------------------------------------------------------------
def test_build_makes_the_engine_free_parts_from_the_config_sections_and_starts_nothing():
    cfg = _config(admission={"max_sequences": 1, "max_tokens": 64, "max_waiting": 1,
                             "queue_timeout_s": 7})
    r = EngineReplica.built(cfg, MODEL)
    snap = r.queue.snapshot()
    assert (snap["max_sequences"], snap["max_tokens"]) == (1, 64)
    assert (snap["max_waiting"], snap["queue_timeout_s"]) == (1, 7)
    assert not hasattr(r, "gate") and not hasattr(r, "path") and r._tasks == []

    async def overload() -> None:  # one admitted, one waiting: the third is refused, counted
        async with r.queue.admit(1, 8):
            waiter = asyncio.ensure_future(r.queue.admit(1, 8).__aenter__())
            await asyncio.sleep(0)
            with pytest.raises(Overloaded):
                async with r.queue.admit(1, 8):
                    pass
            waiter.cancel()

    asyncio.run(overload())
    assert _rejections(r.recorder) == [({"model": MODEL, "reason": "budget_queue_full"}, 1.0)]


# -- the idle floor against the governor's band ------------------------------------------------
def _at_idle(cfg, model: str, ratio: float) -> EngineReplica:
    """A replica built from ``cfg`` whose card reads ``ratio`` at idle."""
    r = EngineReplica.built(cfg, model)
    r.card = CardIdentity(node_id="n", node="node-1", node_ip="10.0.0.1", device="0")
    total = 1000

    async def read_card(fresh: bool = False):
        return SimpleNamespace(ratio=ratio, live_bytes=int(ratio * total),
                               capacity_bytes=total)

    r.follower = SimpleNamespace(read_card=read_card)
    return r


def _floor_errors(r: EngineReplica, caplog) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="embedfleet.replica"):
        asyncio.run(r._check_idle_floor())
    return [rec.getMessage() for rec in caplog.records if "at idle" in rec.getMessage()]


def test_the_idle_floor_is_checked_against_the_models_card_profile_band(caplog):
    """The 910B config names its card profile, whose band (``params_for_profile``) cuts at the
    profile's safe ratio (~0.961), not ``governor.params.high`` (0.90): an idle card at 0.93 is
    below the band the governor will use for it, so no error; at 0.97 it is above, and the error
    names the profile's high."""
    cfg = load_config(ASCEND_8B)
    model = cfg.models[0].name
    high = load_profile(shipped_profile_path(cfg.governor.card_profiles[model])).safe_ratio
    assert cfg.governor.params.high < 0.93 < high < 0.97
    assert _floor_errors(_at_idle(cfg, model, 0.93), caplog) == []
    (err,) = _floor_errors(_at_idle(cfg, model, 0.97), caplog)
    assert f"governor high {high:.2f}" in err and "node-1/0" in err


def test_without_a_card_profile_the_idle_floor_uses_the_configured_high(caplog):
    cfg = _config()
    assert _floor_errors(_at_idle(cfg, MODEL, 0.89), caplog) == []
    (err,) = _floor_errors(_at_idle(cfg, MODEL, 0.93), caplog)
    assert f"governor high {cfg.governor.params.high:.2f}" in err


# -- the direct ingress holds a replica ----------------------------------------------------------
class RecordingReplica:
    """Stands in for the ``EngineReplica`` a ``DirectEngine`` holds: records each call."""

    replica_id = "r-1"

    def __init__(self, embed_s: float = 0.0) -> None:
        self.calls: list[tuple] = []
        self.embed_s = embed_s
        self.stopped = 0

    async def embed(self, call):
        self.calls.append(("embed", call))
        await asyncio.sleep(self.embed_s)
        return "vectors"

    async def rerank(self, call):
        self.calls.append(("rerank", call))
        return "scores"

    async def tokenize_tei(self, texts, add_special_tokens=True, prompt_name=None,
                           lane="interactive"):
        self.calls.append(("tokenize_tei", texts, add_special_tokens, prompt_name, lane))
        return ["tokens"]

    def describe(self):
        self.calls.append(("describe",))
        return "description"

    def record_routing_stats(self):
        self.calls.append(("record_routing_stats",))
        return {"prefix_cache": False, "serving": True}

    async def check_health(self):
        self.calls.append(("check_health",))

    def stop(self):
        self.stopped += 1


def _direct(replica: RecordingReplica, bound_s: float = 5.0) -> DirectEngine:
    d = object.__new__(DirectEngine)
    d.replica, d._bound_s, d._retry_after_s = replica, bound_s, 2
    return d


def test_the_direct_ingress_hands_every_replica_call_to_the_replica_it_holds():
    rec = RecordingReplica()
    d = _direct(rec)
    call = EmbedCall(["a"], "req-1", "m")

    pairs = object()  # a RerankCall, passed through untouched

    async def calls():
        return (await d.embed(call), await d.tokenize_tei(["t"], False, "query", "bulk"),
                d.describe(), d.record_routing_stats(), await d.check_health(),
                await d._bounded_embed(call), await d._tokenize("m", ["u"], True, None, "bulk"),
                await d.rerank(pairs))

    got = asyncio.run(calls())
    assert got == ("vectors", ["tokens"], "description", {"prefix_cache": False, "serving": True},
                   None, "vectors", ["tokens"], "scores")
    assert [c[0] for c in rec.calls] == ["embed", "tokenize_tei", "describe",
                                         "record_routing_stats", "check_health", "embed",
                                         "tokenize_tei", "rerank"]
    assert rec.calls[-1] == ("rerank", pairs)
    assert rec.calls[1] == ("tokenize_tei", ["t"], False, "query", "bulk")
    d.__del__()
    assert rec.stopped == 1  # Serve's shutdown stops the replica it holds


def test_the_direct_ingress_answers_503_past_its_bound():
    d = _direct(RecordingReplica(embed_s=1.0), bound_s=0.05)
    with pytest.raises(EngineUnavailable) as err:
        asyncio.run(d._bounded_embed(EmbedCall(["a"], "req-1", "m")))
    assert err.value.status == 503 and err.value.retry_after_s == 2 and "r-1" in str(err.value)
