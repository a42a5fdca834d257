"""SIMULATION — the real memory governor on a card described by a card profile, not hardware.

    python -m embedfleet.benchmarks.governor_sim [--json] [--profile FILE] [--config FILE]

What runs is embedfleet's own code, on a virtual clock (``VirtualClockLoop``): the replica's
admission budget (``AdmissionBudget``), its limits follower (``LimitsFollower``: the probe, the
card's terms, the allocator counters it reports with each pull), the ``MemoryGovernor`` with its
law and the profile's band, and the KV tracker. What is simulated is the card and the engine,
and every number of the card comes from the profile file (``deployments/engine/card_profile.py``;
by default the shipped 910B profile, whose numbers are assumptions until ``embedfleet
calibrate`` has run on a card):

* outside the KV pool the card holds the profile's idle memory (weights + runtime) and each
  step's activations and workspace, linear in the step's tokens so that the profile's worst
  step reaches its worst-step peak; the KV pool is preallocated and never moves (a step fills
  it, which allocates nothing);
* a caching allocator: what a step allocated stays reserved after it; a step needing more than
  the reusable part of that cache takes new device memory; when there is none it frees its
  whole free segments and retries (``num_alloc_retries``), and fails (``num_ooms``: the engine
  dies and restarts, its step's requests go back to the queue) when even that is not enough.
  Fragmentation is the share of the cache whose segments do not fit the next step's tensors:
  whole free segments, so room a retry hands back rather than pressure; it shows in the retry
  counter, not in the ratio.

Scenarios, one run each with and without the governor: idle; sustained load at the planned
operating point (full-length inputs, full steps, the KV pool full); an overrun beyond the plan
(the step's workspace grows to twice the profile's headroom past its worst step and the cache
fragments); recovery (the overrun ends, the load goes on). Only the overrun's two curves are the
simulation's own input; they are stated in the profile's terms. Time (``--tokens-per-s``,
``--restart-s``) sets how many steps an interval holds, not what memory they take.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import selectors
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..deployments.config.schema import load_config
from ..deployments.fleet.governor import MemoryGovernor
from ..deployments.replica.limits import LimitsFollower
from ..deployments.config.memory_queries import CardReading
from ..deployments.engine.card_memory import live_pressure
from ..deployments.engine.card_profile import (CardProfile, load_profile,
                                               shipped_profile_path)
from ..deployments.engine.gate import EngineGate
from ..deployments.engine.kv_usage import KvUsageTracker
from ..deployments.engine.vllm_engine import EngineMemory
from ..deployments.replica.admission import AdmissionBudget

EPOCH = 1_700_000_000.0  # the governor's wall clock: virtual seconds from this instant
CONFIG = "deployments/configs/ascend-910b-qwen3-embedding-8b.yaml"
PROFILE = shipped_profile_path("ascend-910b-qwen3-embedding-8b")
PHASES = {"idle": 120.0, "operating_point": 300.0, "overrun": 300.0, "recovery": 300.0}
FRAG_RAMP_S = 60.0  # the overrun's fragmentation reaches all of the cache after this long


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock jumps to the next timer instead of sleeping: twenty simulated
    minutes take a second, and every ``asyncio.sleep``/``timeout`` in the real code is honoured."""

    def __init__(self) -> None:
        self._vtime = 0.0
        outer = self

        class _Jump(selectors.DefaultSelector):
            def select(self, timeout: float | None = None):  # type: ignore[override]
                if timeout is not None and timeout > 0:
                    outer._vtime += timeout
                return super().select(0)

        super().__init__(selector=_Jump())

    def time(self) -> float:
        return self._vtime


class Card:
    """The card of a profile, outside its KV pool, with a caching allocator."""

    def __init__(self, p: CardProfile) -> None:
        self.p = p
        self.base = p.idle_outside_pool_bytes            # weights + runtime
        self.room = p.outside_capacity_bytes - self.base  # for activations, workspace, cache
        self.act_per_token = (p.worst_step_peak_bytes - self.base) / p.worst_step.tokens
        self.runtime = self.base - p.weights_bytes        # not the allocator's
        self.reserved = 0       # activation memory the allocator holds (its cache included)
        self.frag = 0.0         # share of that cache whose segments fit no tensor of the step
        self.workspace = 0.0    # the overrun: extra workspace per token, as a share of the plan
        self.retries = self.ooms = 0
        self._peak_held = self._peak_reserved = 0
        self.first_retry_at: float | None = None

    def step(self, tokens: int, now: float) -> bool:
        """Allocate one step; False: out of memory (the engine died)."""
        need = int(self.act_per_token * tokens * (1.0 + self.workspace))
        new = max(0, need - int(self.reserved * (1.0 - self.frag)))
        if new > self.room - self.reserved:
            self.retries += 1   # free the whole free segments (nothing is live between steps)
            if self.first_retry_at is None:
                self.first_retry_at = now
            self.reserved, new = 0, need
            if need > self.room:
                self.ooms += 1
                return False
        self.reserved += new
        self._peak_held = max(self._peak_held, need)
        self._peak_reserved = max(self._peak_reserved, self.reserved)
        return True

    def restart(self) -> None:
        """A new engine: a fresh allocator, its counters from zero."""
        self.reserved, self.retries, self.ooms = 0, 0, 0

    def probe(self) -> dict[str, int]:
        """What ``MemoryProbeExtension`` answers (driver and allocator views); resets peaks."""
        w, pool = self.p.weights_bytes, self.p.kv_pool_bytes
        out = {"kind": 1, "used": self.runtime + w + pool + self.reserved,
               "total": self.p.card_total_bytes, "reserved": w + pool + self.reserved,
               "reserved_peak": w + pool + max(self.reserved, self._peak_reserved),
               "peak_allocated": w + pool + self._peak_held,
               "inactive_split_peak": 0,
               "num_alloc_retries": self.retries, "num_ooms": self.ooms, "weights": w}
        self._peak_held = self._peak_reserved = 0
        return out


@dataclass
class _Request:
    tokens: int
    done: asyncio.Future[None]


class SimEngine:
    """FCFS whole requests, at most ``max_num_batched_tokens`` and ``max_num_seqs`` per step.
    An OOM kills the engine: its step's requests go back to the front of the queue (inputs are
    idempotent), the replica counts it (``LimitsFollower.engine_oom``), the engine restarts."""

    def __init__(self, card: Card, max_tokens: int, max_seqs: int, tokens_per_s: float,
                 restart_s: float, clock, on_oom) -> None:
        self.card, self.max_tokens, self.max_seqs = card, max_tokens, max_seqs
        self.tokens_per_s, self.restart_s, self.on_oom = tokens_per_s, restart_s, on_oom
        self.kv = KvUsageTracker(clock=clock)
        self.kv.configure(1, 1, card.p.kv_pool_bytes)  # bytes only: the pool is not pressure
        self.waiting: deque[_Request] = deque()
        self.down_until = 0.0
        self.engine_ooms = 0
        self.ooms_by_phase: dict[str, int] = {}
        self.phase = "idle"

    async def memory(self, timeout_s: float, idle: bool = False) -> EngineMemory:
        return EngineMemory(probe=self.card.probe(), kv=self.kv.sample())

    def submit(self, tokens: int) -> asyncio.Future[None]:
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(_Request(tokens, fut))
        return fut

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if loop.time() < self.down_until or not self.waiting:
                await asyncio.sleep(0.05)
                continue
            batch, tokens = [], 0
            while (self.waiting and len(batch) < self.max_seqs
                   and tokens + self.waiting[0].tokens <= self.max_tokens):
                batch.append(self.waiting.popleft())
                tokens += batch[-1].tokens
            if not batch:
                batch = [self.waiting.popleft()]
                tokens = batch[0].tokens
            if not self.card.step(tokens, loop.time()):
                self.engine_ooms += 1
                self.ooms_by_phase[self.phase] = self.ooms_by_phase.get(self.phase, 0) + 1
                self.waiting.extendleft(reversed(batch))  # re-queued, nothing lost
                self.card.restart()
                self.on_oom()
                self.down_until = loop.time() + self.restart_s
                continue
            self.kv.observe(1.0, len(batch), len(self.waiting))  # queued work fills the pool
            await asyncio.sleep(tokens / self.tokens_per_s)
            for r in batch:
                r.done.set_result(None)


class ScrapedPrometheus:
    """Ray's metrics agent and Prometheus for the governor: the follower's gauges become visible
    every 10 s, and the answer is the recording rule's formula (``live_pressure``)."""

    def __init__(self, clock, scrape_s: float = 10.0) -> None:
        self._clock, self._scrape_s = clock, scrape_s
        self.exported: dict[str, float] = {}
        self._scraped: dict[str, float] = {}
        self._scraped_at: float | None = None

    def set_gauge(self, name: str, value: float, tags: dict[str, str]) -> None:
        if tags.get("device") == "0" or not tags:
            self.exported[name] = value

    async def scrape_forever(self) -> None:
        while True:
            self._scraped, self._scraped_at = dict(self.exported), self._clock()
            await asyncio.sleep(self._scrape_s)

    async def readings(self) -> dict[tuple[str, str], CardReading]:
        s = self._scraped
        if "embedfleet_card_memory_used_bytes" not in s or self._scraped_at is None:
            return {}
        ratio = live_pressure(s["embedfleet_card_memory_used_bytes"],
                              s["embedfleet_card_memory_total_bytes"],
                              s["embedfleet_kv_cache_pool_bytes"],
                              s["embedfleet_allocator_cache_free_bytes"])
        return {("node-0", "0"): CardReading(ratio, EPOCH + self._scraped_at)}


@dataclass
class Trace:
    ratios: list[tuple[float, str, float]] = field(default_factory=list)
    budgets: list[tuple[float, str, int]] = field(default_factory=list)

    def of(self, phase: str) -> tuple[list[float], list[int]]:
        return ([r for _, p, r in self.ratios if p == phase],
                [b for _, p, b in self.budgets if p == phase])


async def simulate(profile: CardProfile, profile_path: Path, config: str, governor_on: bool,
                   tokens_per_s: float, restart_s: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    cfg = load_config(config)
    m = next(x for x in cfg.models if x.name == profile.model)
    ceiling = m.budget_ceiling
    card = Card(profile)
    prom = ScrapedPrometheus(loop.time)
    gov = MemoryGovernor(cfg.model_dump(mode="json"), cfg.governor.model_copy(
        update={"card_profiles": {m.name: str(profile_path)}}), sink=prom,
        clock=lambda: EPOCH + loop.time(), readings=prom.readings) if governor_on else None
    budget = AdmissionBudget(ceiling.max_sequences, ceiling.max_tokens, max_waiting=100_000,
                             queue_timeout_s=3600, clock=loop.time)
    follower: LimitsFollower
    engine = SimEngine(card, m.engine.max_num_batched_tokens, m.engine.max_num_seqs,
                       tokens_per_s, restart_s, loop.time, lambda: follower.engine_oom())
    follower = LimitsFollower(
        gate=EngineGate(engine), budget=budget, card_tags={"node": "node-0", "device": "0"},
        ceiling=ceiling, interval_s=cfg.governor.interval_s, sink=prom, cpu_card=None,
        peak_window_s=cfg.governor.peak_window_s, clock=loop.time, model=m.name,
        pull_limits=(lambda report: gov.limits_for("node-0", "0", ceiling, report))
        if gov else None)
    trace = Trace()

    def record() -> None:
        if follower.reading is not None:
            trace.ratios.append((loop.time(), engine.phase, follower.reading.ratio))
        trace.budgets.append((loop.time(), engine.phase, budget.limits[1]))

    tasks = [loop.create_task(engine.run()), loop.create_task(prom.scrape_forever()),
             loop.create_task(follower.run(after_tick=record))]
    served = 0

    async def client() -> None:  # full-length inputs, one after another
        nonlocal served
        while True:
            async with budget.admit(1, m.max_model_len):
                await engine.submit(m.max_model_len)
            served += 1

    async def overrun_curves(start: float) -> None:
        # the step's workspace grows to 2 x the profile's headroom past the worst step
        top = 2.0 * profile.headroom_bytes / (card.act_per_token * profile.worst_step.tokens)
        while True:
            t = loop.time() - start
            card.frag = min(1.0, t / FRAG_RAMP_S)
            card.workspace = top * min(1.0, t / PHASES["overrun"])
            await asyncio.sleep(1.0)

    await asyncio.sleep(PHASES["idle"])
    engine.phase = "operating_point"
    # enough clients to keep every step full at the ceiling
    clients = [loop.create_task(client())
               for _ in range(2 * max(1, ceiling.max_tokens // m.max_model_len))]
    await asyncio.sleep(PHASES["operating_point"])
    engine.phase = "overrun"
    curves = loop.create_task(overrun_curves(loop.time()))
    await asyncio.sleep(PHASES["overrun"])
    curves.cancel()
    card.frag = card.workspace = 0.0
    engine.phase = "recovery"
    overrun_end = loop.time()
    recovered = None
    while loop.time() - overrun_end < PHASES["recovery"]:
        await asyncio.sleep(1.0)
        if recovered is None and budget.limits == (ceiling.max_sequences, ceiling.max_tokens):
            recovered = loop.time() - overrun_end
    for t in [*tasks, *clients]:
        t.cancel()
    if gov is not None:
        await gov.stop()

    def frac(budgets: list[int]) -> float:
        return round(min(budgets, default=0) / ceiling.max_tokens, 4)

    idle_r, idle_b = trace.of("idle")
    op_r, op_b = trace.of("operating_point")
    over_r, over_b = trace.of("overrun")
    cut_at = next((t for t, p, b in trace.budgets if p == "overrun" and b < ceiling.max_tokens),
                  None)
    overrun_start = overrun_end - PHASES["overrun"]
    sign = card.first_retry_at
    return {"governor": "on" if governor_on else "off",
            "idle_ratio": round(max(idle_r), 4), "idle_budget_fraction": frac(idle_b),
            # the first reading of the phase can hold the idle tail: from the second on
            "operating_point_ratio": round(max(op_r[1:]), 4),
            "operating_point_budget_fraction": frac(op_b[1:]),
            "operating_point_ooms": engine.ooms_by_phase.get("operating_point", 0),
            "overrun_max_ratio": round(max(over_r), 4),
            "overrun_min_budget_fraction": frac(over_b),
            "overrun_first_retry_s": None if sign is None else round(sign - overrun_start, 1),
            "overrun_cut_s": None if cut_at is None else round(cut_at - overrun_start, 1),
            "overrun_ooms": engine.ooms_by_phase.get("overrun", 0),
            "engine_ooms": engine.engine_ooms, "requests_served": served,
            "requests_queued_at_end": len(engine.waiting),
            "recovered_s": None if recovered is None else round(recovered, 1)}


def _run(profile: CardProfile, path: Path, config: str, on: bool, tokens_per_s: float,
         restart_s: float) -> dict[str, Any]:
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(simulate(profile, path, config, on, tokens_per_s,
                                                restart_s))
    finally:
        loop.close()


def run_both(profile_path: Path = PROFILE, config: str = CONFIG, tokens_per_s: float = 65_536.0,
             restart_s: float = 60.0) -> dict[str, Any]:
    logging.getLogger("embedfleet").setLevel(logging.ERROR)
    profile = load_profile(profile_path)
    off = _run(profile, profile_path, config, False, tokens_per_s, restart_s)
    on = _run(profile, profile_path, config, True, tokens_per_s, restart_s)
    return {
        "simulation": f"one card as profiled in {profile_path.name} ({profile.source}), "
                      "running embedfleet's governor, budget and limits follower; not hardware",
        "profile_source": profile.source,
        "card": {"total_bytes": profile.card_total_bytes,
                 "kv_pool_bytes": profile.kv_pool_bytes,
                 "idle_ratio": round(profile.idle_ratio, 4),
                 "operating_point_ratio": round(profile.operating_point_ratio, 4),
                 "cut_at_ratio": round(profile.safe_ratio, 4)},
        "phases_s": PHASES,
        "runs": [off, on],
        "idle_ratio": on["idle_ratio"],
        "operating_point_ratio": on["operating_point_ratio"],
        "overrun_first_retry_s": on["overrun_first_retry_s"],
        "overrun_cut_s": on["overrun_cut_s"],
        "interval_s": load_config(config).governor.interval_s,
        "card_profile": str(profile_path),
        "idle_budget_fraction": on["idle_budget_fraction"],
        "operating_point_budget_fraction": on["operating_point_budget_fraction"],
        "overrun_ooms_without_governor": off["overrun_ooms"],
        "overrun_ooms_with_governor": on["overrun_ooms"],
        "recovered_s": on["recovered_s"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", type=Path, default=PROFILE, help="card profile (JSON)")
    p.add_argument("--config", default=CONFIG, help="the config whose model the profile is of")
    p.add_argument("--tokens-per-s", type=float, default=65_536.0,
                   help="the card's prefill rate: how long a step takes (the clock only)")
    p.add_argument("--restart-s", type=float, default=60.0,
                   help="how long an engine takes to come back after an OOM")
    p.add_argument("--json", action="store_true", help="print only the JSON (last line)")
    args = p.parse_args(argv)
    report = run_both(args.profile, args.config, args.tokens_per_s, args.restart_s)
    if not args.json:
        for r in report["runs"]:
            print(f"governor {r['governor']}: {r}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
