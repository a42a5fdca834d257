"""MemoryGovernor driven without Serve, against a REAL Prometheus.

The main scenario is issue 4's: two cards on one node read through the npu-exporter preset from
the stand-in exporter; card 1 at 93 % is cut within two control steps while card 0 is untouched;
at 70 % card 1 grows back step by step to its ceiling; with Prometheus stopped the limits are held
and marked stale, and the reason says Prometheus. A second Prometheus loads the shipped recording
rules and proves the embedfleet preset's ``node`` label is the node IP replicas report.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cluster.prometheus_server import free_port, start_prometheus
from deployments import metrics
from deployments.governor import GovernorConfig, MemoryGovernor, RayMetricsSink
from monitoring.exporters.standin_npu_exporter import StandinNpuExporter

ROOT = Path(__file__).resolve().parents[1]
RECORDING_RULES = ROOT / "monitoring/prometheus/rules/embedfleet-recording.yml"
CONFIG = {"models": [{"name": "m", "source": {"path": "/nonexistent"}}]}
NODE = "10.0.0.1"  # the node IP a replica reports (CardIdentity.node_ip)
CEILING = {"max_sequences": 64, "max_tokens": 8192}
INTERVAL_S = 0.6  # just above the 500 ms scrape interval: nearly every step sees a new sample


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


def scrape_config(*jobs: tuple[str, int], rules: bool = False) -> str:
    return json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "500ms", "evaluation_interval": "500ms"},
        **({"rule_files": [RECORDING_RULES.name]} if rules else {}),
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                           for job, port in jobs],
    })


@pytest.fixture
def exporter():
    with StandinNpuExporter() as ex:
        ex.set_ratio(NODE, 0, 0.50)
        ex.set_ratio(NODE, 1, 0.50)
        yield ex


async def tick_until(gov: MemoryGovernor, done, max_ticks: int, what: str):
    states = None
    for _ in range(max_ticks):
        await asyncio.sleep(INTERVAL_S)
        states = await gov.tick()
        if done(states):
            return states
    pytest.fail(f"{what} not reached in {max_ticks} steps; last states: {states!r}")


def test_pressure_on_card_1_cuts_only_card_1_recovers_step_by_step_and_holds_when_blind(
        exporter, tmp_path):
    prom = start_prometheus(scrape_config(("npu", exporter.port)), tmp_path, free_port())
    sink = RecordingSink()
    # Default law (cut ×0.5, step 1/8 of the ceiling) with a cooldown short enough for a test.
    gov = governor(prom.url, sink, params={"cooldown_s": 2.0})
    ceiling = (CEILING["max_sequences"], CEILING["max_tokens"])

    async def scenario():
        for device in ("0", "1"):
            got = await gov.limits_for(NODE, device, CEILING)
            assert (got["max_sequences"], got["max_tokens"]) == ceiling
        await tick_until(gov, lambda s: all(st.ratio is not None and not st.stale
                                            for st in s.values()), 40, "both cards read")

        # 93 % on card 1: cut within two control steps; card 0 untouched.
        exporter.set_ratio(NODE, 1, 0.93)
        for _ in range(2):
            await asyncio.sleep(INTERVAL_S)
            states = await gov.tick()
            if limits(states, "1") < ceiling:
                break
        assert limits(states, "1") == (32, 4096), states[(NODE, "1")].reason
        assert states[(NODE, "1")].action == "decrease" and "0.93" in states[(NODE, "1")].reason
        assert limits(states, "0") == ceiling and not states[(NODE, "0")].stale
        got = await gov.limits_for(NODE, "1", CEILING)
        assert (got["max_sequences"], got["max_tokens"], got["stale"]) == (32, 4096, False)
        assert got["ratio"] == pytest.approx(0.93)
        card1, card0 = {"node": NODE, "device": "1"}, {"node": NODE, "device": "0"}
        assert sink.get("embedfleet_governor_limit_tokens", **card1) == 4096
        assert sink.get("embedfleet_governor_limit_sequences", **card1) == 32
        assert sink.get("embedfleet_governor_memory_ratio", **card1) == pytest.approx(0.93)
        assert sink.get("embedfleet_governor_limit_tokens", **card0) == 8192
        assert sink.get("embedfleet_governor_stale") == 0

        # 70 %: back up by one step (8 seq / 1024 tok) per new sample, to the ceiling.
        exporter.set_ratio(NODE, 1, 0.70)
        seen = [(32, 4096)]
        while seen[-1] != ceiling:
            assert len(seen) < 30, f"no recovery to the ceiling: {seen}"
            await asyncio.sleep(INTERVAL_S)
            states = await gov.tick()
            if limits(states, "1") != seen[-1]:
                seen.append(limits(states, "1"))
            assert limits(states, "0") == ceiling
        assert seen == [(32, 4096), (40, 5120), (48, 6144), (56, 7168), (64, 8192)]

        # Cut again (the 2 s cooldown has passed), then stop Prometheus: the cut limits are
        # held, marked stale.
        exporter.set_ratio(NODE, 1, 0.95)
        await tick_until(gov, lambda s: limits(s, "1") < ceiling, 4, "second cut")
        held_1 = await gov.limits_for(NODE, "1", CEILING)
        prom.stop()
        states = await gov.tick()
        for device in ("0", "1"):
            st = states[(NODE, device)]
            assert st.stale and st.action == "stale" and "Prometheus" in st.reason, st.reason
        assert limits(states, "0") == ceiling
        assert limits(states, "1") == (held_1["max_sequences"], held_1["max_tokens"])
        got = await gov.limits_for(NODE, "1", CEILING)
        assert got["stale"] and "Prometheus unavailable" in got["reason"]
        assert got["max_tokens"] == held_1["max_tokens"] < CEILING["max_tokens"]
        assert sink.get("embedfleet_governor_stale") == 1
        assert sink.get("embedfleet_governor_limit_tokens", **card1) == held_1["max_tokens"]
        snap = await gov.snapshot()
        assert snap["stale"] and not snap["prometheus_ok"]
        assert "Prometheus" in snap["prometheus_error"]
        assert [(c["device"], c["stale"]) for c in snap["cards"]] == [("0", True), ("1", True)]
        # Still blind on the next step: the same limits, no flapping.
        states = await gov.tick()
        assert limits(states, "1") == (held_1["max_sequences"], held_1["max_tokens"])

    try:
        asyncio.run(scenario())
    finally:
        prom.stop()


class FakeRayAgent:
    """Serves embedfleet card memory series as Ray's metrics agent would after export."""

    def __init__(self) -> None:
        self.cards: dict[tuple[str, str], tuple[float, float]] = {}
        agent = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                lines = []
                for (node, device), (used, total) in sorted(agent.cards.items()):
                    labels = f'device="{device}",node="{node}",NodeAddress="{node}"'
                    lines += [f"ray_embedfleet_card_memory_used_bytes{{{labels}}} {used}",
                              f"ray_embedfleet_card_memory_total_bytes{{{labels}}} {total}"]
                body = ("\n".join(lines) + "\n").encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One Prometheus for the tests that do not stop it: the stand-in npu-exporter (job "npu")
    and a fake Ray metrics agent (job "ray") with the shipped recording rules."""
    agent = FakeRayAgent()
    with StandinNpuExporter() as npu:
        prom = start_prometheus(scrape_config(("npu", npu.port), ("ray", agent.port), rules=True),
                                tmp_path_factory.mktemp("prom"), free_port(),
                                files={RECORDING_RULES.name: RECORDING_RULES.read_text()})
        try:
            yield prom, npu, agent
        finally:
            prom.stop()
            agent.close()


def test_embedfleet_preset_matches_replica_node_ips_and_the_loop_runs_in_background(shared):
    prom, _, agent = shared
    # As after Ray's export: the series carry the replica's node IP in `node`; the scrape job
    # "ray" gives them job="ray" as in the shipped scrape config, and the shipped recording rule
    # computes card:embedfleet_memory:ratio from them.
    agent.cards[("10.0.0.2", "3")] = (0.95e9, 1e9)
    agent.cards[("10.0.0.2", "4")] = (0.40e9, 1e9)
    sink = RecordingSink()

    async def scenario():
        gov = MemoryGovernor(CONFIG, {"prometheus_url": prom.url, "interval_s": 0.5}, sink=sink)
        assert (await gov.snapshot())["running"]  # started on the running loop
        deadline = time.monotonic() + 30
        while True:
            hot = await gov.limits_for("10.0.0.2", "3", CEILING)
            cool = await gov.limits_for("10.0.0.2", "4", CEILING)
            if hot["max_tokens"] < CEILING["max_tokens"]:
                break
            assert time.monotonic() < deadline, f"no cut via the embedfleet preset: {hot}"
            await asyncio.sleep(0.2)
        assert hot["ratio"] == pytest.approx(0.95) and "0.95" in hot["reason"]
        assert cool["max_tokens"] == CEILING["max_tokens"]
        snap = await gov.snapshot()
        assert snap["ticks"] >= 1 and snap["tick_errors"] == 0
        await gov.check_health()
        await gov.stop()
        assert not (await gov.snapshot())["running"]

    asyncio.run(scenario())


def test_node_aliases_map_exporter_names_to_replica_ips(shared):
    prom, npu, _ = shared
    npu.set_ratio("gpu-host-7", 0, 0.97)
    gov = governor(prom.url, RecordingSink(), node_aliases={"gpu-host-7": "10.0.0.7"})

    async def scenario():
        await gov.limits_for("10.0.0.7", "0", CEILING)
        states = await tick_until(gov, lambda s: s[("10.0.0.7", "0")].action == "decrease", 40,
                                  "cut via alias")
        assert states[("10.0.0.7", "0")].ratio == pytest.approx(0.97)

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
        assert (got["max_sequences"], got["max_tokens"]) == (8, 1000)
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
