"""MemoryGovernor driven without Serve, against a REAL Prometheus, on pressure outside the KV pool.

Cards are 64 GiB cards at vLLM's 0.95 reservation: the device always reads ~0.95 used, which is
above the governor's high mark, so a governor on raw used/total would cut every idle card. The
signal is ``embedfleet.deployments.engine.card_memory.live_pressure``; expected ratios are derived
with it.

The main scenario: two cards on one node read through the npu-exporter preset from the STAND-IN
npu-exporter (device used/total) and the STAND-IN Ray metrics agent (the replicas' KV pool,
allocator cache and runtime total); both idle cards read 0.72 and keep their ceiling; card 1's
KV pool fills and nothing happens (the pool was preallocated); a step's activations take card
1's allocator cache and it is cut within two control steps while card 0 is untouched; idle
again, card 1 grows back step by step to its ceiling; with Prometheus stopped the limits are
held and marked stale, and the reason says Prometheus. A second Prometheus evaluates the
recording rules generated from ``monitoring/prometheus/rules.py`` and proves the embedfleet
preset's ``node`` label is the node IP replicas report, and that it too cuts on that pressure.
Without Prometheus: the allocator's retry/OOM counters, reported with a pull, cut at once; a
card profile sets a model's band.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from embedfleet.deployments.config.governor import GovernorParams
from embedfleet.deployments.fleet.governor_law import CardReport
from embedfleet.deployments.engine.card_memory import AllocatorCounters
from embedfleet.cluster.prometheus_server import free_port, start_prometheus
from embedfleet.deployments.common import metrics
from embedfleet.deployments.engine.card_memory import live_pressure
from embedfleet.deployments.fleet.governor import MemoryGovernor, RayMetricsSink
from embedfleet.deployments.config.governor import GovernorConfig
from embedfleet.monitoring.prometheus import config as prom_config
from embedfleet.monitoring.prometheus import generate as prom_generate
from embedfleet.monitoring import thresholds
from embedfleet.monitoring.prometheus import rules
from embedfleet.deployments.config import memory_queries
from tests.support.standin_npu_exporter import StandinNpuExporter
from tests.support.standin_ray_agent import StandinRayAgent

RECORDING_RULES = prom_config.RULE_FILES[0]
# The rules as ``python -m embedfleet.monitoring.generate`` writes them (test_monitoring_generated checks
# that the checked-in file is this text).
RECORDING_RULES_TEXT = prom_generate.dump(rules.recording_groups())
CONFIG = {"models": [{"name": "m", "source": {"path": "/nonexistent"}}]}
NODE = "10.0.0.1"  # the node IP a replica reports (CardIdentity.node_ip)
CEILING = {"max_sequences": 64, "max_tokens": 8192}
INTERVAL_S = 0.6  # just above the 500 ms scrape interval: nearly every step sees a new sample

# A 64 GiB card at gpu_memory_utilization 0.95 with a 24 GiB KV pool. npu-exporter reports MB;
# the replicas report bytes (the same total here: tests/test_memory_queries.py has them differ).
GiB, MiB = 1 << 30, 1 << 20
TOTAL_MB = 65536.0
RESERVED_MB = 0.95 * TOTAL_MB
TOTAL, RESERVED = TOTAL_MB * MiB, RESERVED_MB * MiB
KV_POOL = 24 * GiB
IDLE = {"kv_pool": KV_POOL, "kv_free": KV_POOL, "cache_free": 8 * GiB}  # warm-up's cache idle
POOL_FULL = {**IDLE, "kv_free": 0}                                      # queued work in the pool
HOT = {"kv_pool": KV_POOL, "kv_free": 0, "cache_free": int(0.4 * GiB)}  # a step holds the cache
IDLE_LIVE = live_pressure(RESERVED, TOTAL, KV_POOL, IDLE["cache_free"])
HOT_LIVE = live_pressure(RESERVED, TOTAL, KV_POOL, HOT["cache_free"])
PARAMS = GovernorParams()


def test_the_profile_spans_the_band():
    """The premise: raw used/total would cut; idle grows; a step holding the cache cuts."""
    assert RESERVED / TOTAL >= PARAMS.high
    assert IDLE_LIVE < PARAMS.low < PARAMS.high < HOT_LIVE < 1


class RecordingSink:
    """Keeps the last value of every gauge; checks each against its declared spec."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple], float] = {}

    def set_gauge(self, name: str, value: float, tags: dict[str, str]) -> None:
        spec = metrics.BY_NAME[name]
        assert spec.kind == "gauge" and set(tags) == set(spec.tags), (name, tags)
        self.values[(name, tuple(sorted(tags.items())))] = value

    def get(self, name: str, **tags: str) -> float | None:
        return self.values.get((name, tuple(sorted(tags.items()))))


def governor(url: str, sink: RecordingSink, **settings) -> MemoryGovernor:
    settings = {"prometheus_url": url, "query_preset": "npu-exporter",
                "interval_s": INTERVAL_S, **settings}
    return MemoryGovernor(CONFIG, settings, sink=sink, autostart=False)


def limits(states, device: str) -> tuple[int, int]:
    lim = states[(NODE, device)].limits
    return lim.max_sequences, lim.max_tokens


def scrape_config(*jobs: tuple[str, int], with_rules: bool = False) -> str:
    return json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "500ms", "evaluation_interval": "500ms"},
        **({"rule_files": [RECORDING_RULES]} if with_rules else {}),
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                           for job, port in jobs],
    })


@pytest.fixture
def exporter():
    with StandinNpuExporter() as ex:
        ex.set_card(NODE, 0, RESERVED_MB, TOTAL_MB)
        ex.set_card(NODE, 1, RESERVED_MB, TOTAL_MB)
        yield ex


@pytest.fixture
def agent():
    """The replicas on NODE, idle: all four terms, as a replica exports them."""
    with StandinRayAgent() as ag:
        for device in (0, 1):
            ag.set_card(NODE, device, used=RESERVED, total=TOTAL, **IDLE)
        yield ag


async def tick_until(gov: MemoryGovernor, done, max_ticks: int, what: str):
    states = None
    for _ in range(max_ticks):
        await asyncio.sleep(INTERVAL_S)
        states = await gov.tick()
        if done(states):
            return states
    pytest.fail(f"{what} not reached in {max_ticks} steps; last states: {states!r}")


@pytest.mark.prometheus  # a real Prometheus, waited on: not in `make test-unit`
def test_pressure_on_card_1_cuts_only_card_1_recovers_step_by_step_and_holds_when_blind(
        exporter, agent, tmp_path):
    prom = start_prometheus(scrape_config(("npu", exporter.port), ("ray", agent.port)), tmp_path,
                            free_port())
    sink = RecordingSink()
    # Default law (cut ×0.5, step 1/8 of the ceiling) with a cooldown short enough for a test.
    gov = governor(prom.url, sink, params={"cooldown_s": 2.0}, peak_window_s=2.0)
    ceiling = (CEILING["max_sequences"], CEILING["max_tokens"])
    card1, card0 = {"node": NODE, "device": "1"}, {"node": NODE, "device": "0"}

    async def scenario():
        for device in ("0", "1"):
            got = await gov.limits_for(NODE, device, CEILING)
            assert (got.max_sequences, got.max_tokens) == ceiling
        await tick_until(gov, lambda s: all(st.ratio is not None and not st.stale
                                            for st in s.values()), 40, "both cards read")

        # Both cards read 0.95 on the device, above high; outside their KV pools they are at
        # 0.72: a few more steps, and neither is ever cut. Card 1's KV pool fills up meanwhile:
        # it was preallocated, so nothing moves.
        agent.set_card(NODE, 1, **POOL_FULL)
        for _ in range(4):
            await asyncio.sleep(INTERVAL_S)
            states = await gov.tick()
            for device in ("0", "1"):
                st = states[(NODE, device)]
                assert st.ratio == pytest.approx(IDLE_LIVE) and not st.stale, st.reason
                assert st.action != "decrease" and limits(states, device) == ceiling, st.reason
        assert sink.get("embedfleet_governor_memory_ratio", **card1) == pytest.approx(IDLE_LIVE)

        # A step's activations take card 1's allocator cache (same device reading): cut within
        # two control steps; card 0 untouched.
        agent.set_card(NODE, 1, **HOT)
        for _ in range(2):
            await asyncio.sleep(INTERVAL_S)
            states = await gov.tick()
            if limits(states, "1") < ceiling:
                break
        assert limits(states, "1") == (32, 4096), states[(NODE, "1")].reason
        st1 = states[(NODE, "1")]
        assert st1.action == "decrease" and st1.ratio == pytest.approx(HOT_LIVE)
        assert f"memory {st1.ratio:g} ≥ high 0.9" in st1.reason
        assert limits(states, "0") == ceiling and not states[(NODE, "0")].stale
        got = await gov.limits_for(NODE, "1", CEILING)
        assert (got.max_sequences, got.max_tokens, got.stale) == (32, 4096, False)
        assert got.ratio == pytest.approx(HOT_LIVE)
        assert sink.get("embedfleet_governor_limit_tokens", **card1) == 4096
        assert sink.get("embedfleet_governor_limit_sequences", **card1) == 32
        assert sink.get("embedfleet_governor_memory_ratio", **card1) == pytest.approx(HOT_LIVE)
        assert sink.get("embedfleet_governor_high", **card1) == PARAMS.high  # no profile
        assert sink.get("embedfleet_governor_limit_tokens", **card0) == 8192
        assert sink.get("embedfleet_governor_memory_ratio", **card0) == pytest.approx(IDLE_LIVE)
        assert sink.get("embedfleet_governor_stale") == 0

        # The step ends (the device still reads 0.95): back up by one step (8 seq / 1024 tok)
        # per new sample, to the ceiling.
        agent.set_card(NODE, 1, **IDLE)
        seen = [(32, 4096)]
        while seen[-1] != ceiling:
            assert len(seen) < 30, f"no recovery to the ceiling: {seen}"
            await asyncio.sleep(INTERVAL_S)
            states = await gov.tick()
            if limits(states, "1") != seen[-1]:
                seen.append(limits(states, "1"))
                assert states[(NODE, "1")].ratio == pytest.approx(IDLE_LIVE)
            assert limits(states, "0") == ceiling
        assert seen == [(32, 4096), (40, 5120), (48, 6144), (56, 7168), (64, 8192)]

        # Cut again (the 2 s cooldown has passed), then stop Prometheus: the cut limits are
        # held, marked stale.
        agent.set_card(NODE, 1, **HOT)
        await tick_until(gov, lambda s: limits(s, "1") < ceiling, 4, "second cut")
        held_1 = await gov.limits_for(NODE, "1", CEILING)
        prom.stop()
        states = await gov.tick()
        for device in ("0", "1"):
            st = states[(NODE, device)]
            assert st.stale and st.action == "stale" and "Prometheus" in st.reason, st.reason
        assert limits(states, "0") == ceiling
        assert limits(states, "1") == (held_1.max_sequences, held_1.max_tokens)
        got = await gov.limits_for(NODE, "1", CEILING)
        assert got.stale and "Prometheus unavailable" in got.reason
        assert got.max_tokens == held_1.max_tokens < CEILING["max_tokens"]
        assert sink.get("embedfleet_governor_stale") == 1
        assert sink.get("embedfleet_governor_limit_tokens", **card1) == held_1.max_tokens
        snap = await gov.snapshot()
        assert snap["stale"] and not snap["prometheus_ok"]
        assert "Prometheus" in snap["prometheus_error"]
        assert [(c["device"], c["stale"]) for c in snap["cards"]] == [("0", True), ("1", True)]
        # Still blind on the next step: the same limits, no flapping.
        states = await gov.tick()
        assert limits(states, "1") == (held_1.max_sequences, held_1.max_tokens)

    try:
        asyncio.run(scenario())
    finally:
        prom.stop()


@pytest.mark.prometheus  # a real Prometheus, waited on: not in `make test-unit`
def test_a_card_whose_replica_stops_reporting_its_kv_term_is_held_stale(exporter, agent,
                                                                         tmp_path, monkeypatch):
    # The device reading alone is vLLM's reservation: without the replica's KV pool term there
    # is no ratio, and the governor holds the card (stale) rather than cut it on a raw 0.95.
    # The preset is built with an 8 s Ray-gauge lookback, not the shipped 30 s
    # (thresholds.RAY_GAUGE_LOOKBACK): the same query, 22 s less waiting.
    monkeypatch.setattr(thresholds, "RAY_GAUGE_LOOKBACK", "8s")
    monkeypatch.setitem(memory_queries.PRESETS, "npu-exporter", memory_queries.npu_exporter_query())
    assert "[8s]" in memory_queries.PRESETS["npu-exporter"].ratio
    prom = start_prometheus(scrape_config(("npu", exporter.port), ("ray", agent.port)), tmp_path,
                            free_port())
    gov = governor(prom.url, RecordingSink())

    async def scenario():
        await gov.limits_for(NODE, "1", CEILING)
        await tick_until(gov, lambda s: s[(NODE, "1")].ratio is not None, 40, "card read")
        agent.drop(NODE, 1, "kv_pool")
        # its last KV sample ages out of the query's last_over_time lookback, then held
        states = await tick_until(gov, lambda s: s[(NODE, "1")].stale, 48, "card held stale")
        st = states[(NODE, "1")]
        assert st.action == "stale" and "no memory series" in st.reason, st.reason
        assert limits(states, "1") == (CEILING["max_sequences"], CEILING["max_tokens"])

    try:
        asyncio.run(scenario())
    finally:
        prom.stop()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One Prometheus for the tests that do not stop it: the stand-in npu-exporter (job "npu")
    and the stand-in Ray metrics agent (job "ray") with the recording rules."""
    with StandinNpuExporter() as npu, StandinRayAgent() as agent:
        prom = start_prometheus(scrape_config(("npu", npu.port), ("ray", agent.port),
                                              with_rules=True),
                                tmp_path_factory.mktemp("prom"), free_port(),
                                files={RECORDING_RULES: RECORDING_RULES_TEXT})
        try:
            yield prom, npu, agent
        finally:
            prom.stop()


@pytest.mark.prometheus  # a real Prometheus, waited on: not in `make test-unit`
def test_embedfleet_preset_matches_replica_node_ips_and_the_loop_runs_in_background(shared):
    prom, _, agent = shared
    # As after Ray's export: the series carry the replica's node IP in `node`; the scrape job
    # "ray" gives them job="ray" as in the shipped scrape config, and the recording rule
    # computes card:embedfleet_memory:ratio from the four terms. Both cards read 0.95 of the
    # device and both KV pools are full; card 3 runs a step that holds its allocator's cache.
    agent.set_card("10.0.0.2", 3, used=RESERVED, total=TOTAL, **HOT)
    agent.set_card("10.0.0.2", 4, used=RESERVED, total=TOTAL, **POOL_FULL)
    sink = RecordingSink()

    async def scenario():
        gov = MemoryGovernor(CONFIG, {"prometheus_url": prom.url, "interval_s": 0.5}, sink=sink)
        assert (await gov.snapshot())["running"]  # started on the running loop
        deadline = time.monotonic() + 30
        while True:
            hot = await gov.limits_for("10.0.0.2", "3", CEILING)
            cool = await gov.limits_for("10.0.0.2", "4", CEILING)
            assert cool.max_tokens == CEILING["max_tokens"], cool  # raw 0.95, full pool: never cut
            if hot.max_tokens < CEILING["max_tokens"]:
                break
            assert time.monotonic() < deadline, f"no cut via the embedfleet preset: {hot}"
            await asyncio.sleep(0.2)
        assert hot.ratio == pytest.approx(HOT_LIVE) and "≥ high 0.9" in hot.reason
        assert f"memory {hot.ratio:g}" in hot.reason
        for _ in range(3):  # the loop keeps reading the idle card live, and keeps it whole
            await asyncio.sleep(0.5)
            cool = await gov.limits_for("10.0.0.2", "4", CEILING)
            assert cool.max_tokens == CEILING["max_tokens"], cool
            assert cool.max_sequences == CEILING["max_sequences"], cool
        assert cool.ratio == pytest.approx(IDLE_LIVE) and not cool.stale, cool
        snap = await gov.snapshot()
        assert snap["ticks"] >= 1 and snap["tick_errors"] == 0
        await gov.check_health()
        await gov.stop()
        assert not (await gov.snapshot())["running"]

    asyncio.run(scenario())


@pytest.mark.prometheus  # a real Prometheus, waited on: not in `make test-unit`
def test_node_aliases_map_exporter_names_to_replica_ips(shared):
    prom, npu, agent = shared
    # npu-exporter names the node gpu-host-7 (the scrape config's label); the replica on it
    # reports its IP. The alias is applied inside the query, so the replica's terms join.
    npu.set_card("gpu-host-7", 0, RESERVED_MB, TOTAL_MB)
    agent.set_card("10.0.0.7", 0, used=RESERVED, total=TOTAL, **IDLE)
    gov = governor(prom.url, RecordingSink(), node_aliases={"gpu-host-7": "10.0.0.7"})
    key = ("10.0.0.7", "0")

    async def scenario():
        await gov.limits_for(*key, CEILING)
        states = await tick_until(gov, lambda s: s[key].ratio is not None and not s[key].stale,
                                  40, "card read via alias")
        assert states[key].ratio == pytest.approx(IDLE_LIVE)  # not the raw 0.95
        assert states[key].action != "decrease" and states[key].limits.max_tokens == 8192
        agent.set_card("10.0.0.7", 0, **HOT)
        states = await tick_until(gov, lambda s: s[key].action == "decrease", 40,
                                  "cut via alias")
        assert states[key].ratio == pytest.approx(HOT_LIVE)
        assert states[key].limits.max_tokens == 4096

    asyncio.run(scenario())


# --- without Prometheus ------------------------------------------------------------------------

def test_unreachable_prometheus_holds_the_ceiling_and_says_why():
    sink = RecordingSink()
    gov = governor(f"http://127.0.0.1:{free_port()}", sink)

    async def scenario():
        assert await gov.tick() == {}  # no cards: nothing to query
        assert sink.get("embedfleet_governor_stale") == 0
        await gov.limits_for(NODE, "0", CEILING)
        st = (await gov.tick())[(NODE, "0")]
        assert st.stale and "Prometheus unavailable" in st.reason
        assert (st.limits.max_sequences, st.limits.max_tokens) == (64, 8192)
        assert sink.get("embedfleet_governor_stale") == 1
    asyncio.run(scenario())


def test_ceiling_changes_apply_at_once_and_idle_cards_are_forgotten():
    now = [1000.0]
    gov = MemoryGovernor(CONFIG, {"prometheus_url": f"http://127.0.0.1:{free_port()}",
                                  "interval_s": 1, "forget_after_s": 10},
                         sink=RecordingSink(), clock=lambda: now[0], autostart=False)

    async def scenario():
        await gov.limits_for(NODE, "0", CEILING)
        got = await gov.limits_for(NODE, "0", {"max_sequences": 8, "max_tokens": 1000})
        assert (got.max_sequences, got.max_tokens) == (8, 1000)
        with pytest.raises(ValueError):  # pydantic's ValidationError is a ValueError
            await gov.limits_for(NODE, "0", {"max_sequences": 0, "max_tokens": 1})
        now[0] += 11
        assert await gov.tick() == {}
        assert (await gov.snapshot())["cards"] == []
    asyncio.run(scenario())


def test_governor_config_is_strict_and_maps_node_labels():
    with pytest.raises(ValueError, match="extra"):
        GovernorConfig(prometheus_url="http://x", bogus=1)
    with pytest.raises(ValueError, match="node_label"):
        GovernorConfig(query_preset="embedfleet", node_label="instance")
    with pytest.raises(ValueError, match="forget_after_s"):
        GovernorConfig(interval_s=30, forget_after_s=60)
    with pytest.raises(ValueError, match=r"cooldown_s \(5.0\) must be at least "
                                              r"peak_window_s \(15.0\)"):
        GovernorConfig(params={"cooldown_s": 5})
    q = GovernorConfig(query_preset="npu-exporter", node_label="instance").card_query()
    assert '"instance"' in q.ratio and "npu_chip_info_hbm_used_memory" in q.ratio
    assert "DCGM_FI_DEV_FB_USED" in GovernorConfig(query_preset="dcgm").card_query().ratio
    assert GovernorConfig().card_query().ratio == "card:embedfleet_memory:ratio"


def test_ray_sink_never_raises(monkeypatch):
    def broken(name):
        raise RuntimeError("no metrics agent")

    monkeypatch.setattr(metrics, "get", broken)
    sink = RayMetricsSink()
    sink.set_gauge("embedfleet_governor_stale", 1, {})
    sink.set_gauge("embedfleet_governor_stale", 1, {})


# --- hard triggers and card profiles (no Prometheus: the readings are given) -------------------

class Readings:
    """The governor's reading source, set by the test (a ratio for every card), or down."""

    def __init__(self, ratio: float) -> None:
        self.ratio, self.down, self.at = ratio, False, 0.0

    async def __call__(self):
        if self.down:
            raise memory_queries.PrometheusUnavailable("stopped by the test")
        self.at += 1.0  # a new sample every tick
        return {(NODE, d): memory_queries.CardReading(self.ratio, 1000.0 + self.at)
                for d in ("0", "1")}


def report(model: str | None = "m", retries: int = 0, ooms: int = 0, engine_ooms: int = 0):
    return CardReport(model=model, engine_ooms=engine_ooms,
                      allocator=AllocatorCounters(num_alloc_retries=retries, num_ooms=ooms))


def quiet_governor(readings: Readings, **settings) -> MemoryGovernor:
    now = [1000.0]
    gov = MemoryGovernor(CONFIG, {"prometheus_url": "http://127.0.0.1:9", **settings},
                         sink=RecordingSink(), clock=lambda: now[0] + readings.at,
                         autostart=False, readings=readings)
    return gov


def test_allocator_retries_and_ooms_cut_at_once_whatever_the_ratio():
    readings = Readings(0.1)  # far below low: the ratio alone would only ever grow
    gov = quiet_governor(readings)

    async def scenario():
        got = await gov.limits_for(NODE, "0", CEILING, report())  # first report: the baseline
        assert (got.max_sequences, got.max_tokens) == (64, 8192)
        await gov.tick()
        # One retry since the last pull: cut in the same pull, not at the next scrape.
        got = await gov.limits_for(NODE, "0", CEILING, report(retries=1))
        assert (got.max_sequences, got.max_tokens) == (32, 4096) and got.action == "decrease"
        assert "1 allocator retries" in got.reason, got.reason
        # The same counters again: nothing new, no second cut; the low ratio then grows it.
        got = await gov.limits_for(NODE, "0", CEILING, report(retries=1))
        assert got.max_tokens == 4096
        # Another retry right away: cut again, cooldown or not.
        got = await gov.limits_for(NODE, "0", CEILING, report(retries=2))
        assert got.max_tokens == 2048
        # Prometheus down, limits stale: an OOM still cuts.
        readings.down = True
        st = (await gov.tick())[(NODE, "0")]
        assert st.stale
        got = await gov.limits_for(NODE, "0", CEILING, report(retries=2, ooms=1))
        assert got.max_tokens == 1024 and "1 allocator OOMs" in got.reason
        assert got.stale and "Prometheus unavailable" in got.reason  # still says it is blind
        # A new engine: its counters start again from 0 (no cut), then its own retry cuts.
        got = await gov.limits_for(NODE, "0", CEILING, report())
        assert got.max_tokens == 1024
        got = await gov.limits_for(NODE, "0", CEILING, report(retries=1))
        assert got.max_tokens == 512  # the floor (1/16 of 8192)
        # At the floor a trigger holds; an engine OOM in a step is reported the same way.
        got = await gov.limits_for(NODE, "0", CEILING, report(retries=1, engine_ooms=1))
        assert got.max_tokens == 512 and "already at floor" in got.reason
        assert "1 engine OOMs in a step" in got.reason

    asyncio.run(scenario())


def _save_profile(tmp_path, *, model: str = "m", platform: str = "cpu") -> str:
    """A measured profile: card 12 GiB, pool 2, so 10 GiB outside it; idle 2 GiB (0.2); the
    worst step 9.3 GiB (0.93, above the default high 0.90); margin 0.3 GiB (cut at 0.97)."""
    from datetime import datetime, timezone

    from embedfleet.deployments.engine.card_profile import (CardProfile, WorstStep,
                                                            save_profile)
    p = CardProfile(source="measured", platform=platform, app_name="embedfleet", model=model,
                    model_source="/nonexistent", engine_version="0.0", plugin_version=None,
                    measured_at=datetime.now(timezone.utc), card_total_bytes=12 * GiB,
                    kv_pool_bytes=2 * GiB, weights_bytes=GiB, idle_outside_pool_bytes=2 * GiB,
                    worst_step_peak_bytes=int(9.3 * GiB),
                    headroom_bytes=12 * GiB - 2 * GiB - int(9.3 * GiB),
                    safety_margin_bytes=int(0.3 * GiB),
                    allocator=AllocatorCounters(num_alloc_retries=0, num_ooms=0),
                    worst_step=WorstStep(sequences=2, tokens=8192, tokens_per_sequence=4096))
    return str(save_profile(p, tmp_path / f"{model}-{platform}.json"))


def test_a_card_profile_sets_its_models_band(tmp_path):
    path = _save_profile(tmp_path)
    readings = Readings(0.93)  # the profiled card at its planned operating point
    gov = quiet_governor(readings, card_profiles={"m": path})
    high, low = gov.params_for("m").high, gov.params_for("m").low
    assert high == pytest.approx(0.97) and low == pytest.approx(0.93)
    assert gov.params_for(None).high == PARAMS.high  # a card that names no model: the config

    async def scenario():
        await gov.limits_for(NODE, "0", CEILING, report("m"))
        await gov.limits_for(NODE, "1", CEILING, report(None))
        states = await gov.tick()
        # 0.93 is the plan for m's cards (held at the ceiling), and past 0.90 for the other.
        assert limits(states, "0") == (64, 8192), states[(NODE, "0")].reason
        assert limits(states, "1") == (32, 4096)
        readings.ratio = 0.975  # past the profile's margin: cut
        states = await gov.tick()
        assert limits(states, "0") == (32, 4096) and "≥ high 0.97" in states[(NODE, "0")].reason
        snap = {c["device"]: c for c in (await gov.snapshot())["cards"]}
        assert snap["0"]["profile"] == path and snap["0"]["high"] == pytest.approx(0.97)
        assert snap["1"]["profile"] is None and snap["1"]["high"] == PARAMS.high

    asyncio.run(scenario())


def test_a_profile_of_another_model_or_platform_is_not_used(tmp_path, caplog):
    other = _save_profile(tmp_path, platform="ascend")
    gov = quiet_governor(Readings(0.5), card_profiles={"m": other})
    assert gov.profiles == {} and gov.params_for("m") == gov.settings.params
    assert "is for m on ascend, not m on cpu" in caplog.text
    missing = quiet_governor(Readings(0.5), card_profiles={"m": str(tmp_path / "none.json")})
    assert missing.profiles == {} and "cannot read card profile" in caplog.text
