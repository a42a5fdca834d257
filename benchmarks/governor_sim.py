"""SIMULATION — the real memory governor on a simulated 64 GB 910B card with vLLM's reservation.

    python -m embedfleet.benchmarks.governor_sim [--json] [--seed 0] [--surge 400]

Nothing here touches a card. What is simulated is the card and the engine; what runs is
embedfleet's own code, on a virtual clock (``VirtualClockLoop``):

* ``AdmissionBudget`` — the replica's admission of sequences and tokens (the actuator);
* ``LimitsFollower`` — reads the engine's memory probe, computes the live ratio
  (``embedfleet.deployments.engine.card_memory``) and pulls the card's limits;
* ``MemoryGovernor`` — its control loop and law, reading the card through a ``ReadingSource``
  that plays Prometheus (the latest exported terms, scraped every 5 s);
* ``KvUsageTracker`` — the in-step KV peak from the engine's per-step statistics.

The card (``Card``) follows vLLM-Ascend's memory semantics (worker.determine_available_memory):
``gpu_memory_utilization`` (0.95) of 64 GiB is planned up front as weights + non-torch runtime +
the activation peak profiled at ``max_num_batched_tokens`` + a KV pool that fills the rest. A
step allocates KV blocks for its tokens (inside the pool), activations for its tokens (inside the
profiled peak), and — for long sequences — attention workspace ∝ L² that the profile run (short
dummy sequences) never planned: that lands beyond the reservation. The caching allocator keeps
its high-water mark reserved. A step needing more than the card has is an OOM: every request on
the card fails (clients retry them) and the engine reloads for ``restart_s``.

The scheduler is vLLM's shape for pooling: FCFS, whole requests, at most
``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences per step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import selectors
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from embedfleet.deployments.request_path.admission import AdmissionBudget
from embedfleet.deployments.engine.card_memory import live_pressure
from embedfleet.deployments.config import load_config
from embedfleet.deployments.engine.vllm_engine import EngineMemory
from embedfleet.deployments.engine.gate import EngineGate
from embedfleet.deployments.errors import Overloaded
from embedfleet.deployments.control.governor import MemoryGovernor
from embedfleet.deployments.control.limits import LimitsFollower
from embedfleet.deployments.engine.kv_usage import KvUsageTracker
from embedfleet.deployments.control.memory_queries import CardReading

GiB = 1 << 30
KiB = 1 << 10
EPOCH = 1_700_000_000.0  # the governor's wall clock: virtual seconds from this instant
CONFIG = "deployments/configs/ascend-910b-qwen3-embedding-8b.yaml"


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock jumps to the next timer instead of sleeping: ten simulated
    minutes take milliseconds, and every ``asyncio.sleep``/``timeout`` in the real code is honoured."""

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


@dataclass
class Card:
    """Qwen3-Embedding-8B (bf16) on a 64 GiB 910B at the shipped config's settings."""

    total: int = 64 * GiB
    util: float = 0.95
    weights: int = int(14.1 * GiB)          # 7.57 B parameters x 2 bytes
    non_torch: int = int(2.5 * GiB)         # CANN runtime, HCCL/ATB workspaces
    act_per_token: int = 72 * KiB           # activations: profiled peak 4.5 GiB at 65,536 tokens
    kv_per_token: int = 144 * KiB           # 36 layers x 8 KV heads x 128 x (K, V) x 2 bytes
    block: int = 128                        # what vllm-ascend runs with prefix caching on
    long_seq_bytes_per_token2: float = 2.0  # unplanned attention workspace: 2 B x L^2 per sequence
    tokens_per_s: float = 24_000.0          # prefill throughput of one 910B on this model
    restart_s: float = 90.0                 # engine reload after an OOM
    max_batched: int = 65_536
    max_seqs: int = 128
    # state
    act_reserved: int = 0                   # the caching allocator's high-water mark (activations)
    peak_alloc: int = 0                     # peak allocated since the last probe
    ooms: int = 0

    def __post_init__(self) -> None:
        self.profiled_act = self.act_per_token * self.max_batched
        self.pool = int(self.util * self.total) - self.weights - self.non_torch - self.profiled_act
        self.num_blocks = self.pool // (self.kv_per_token * self.block)
        self.act_reserved = self.profiled_act  # warm-up runs leave the profiled peak cached
        self.peak_alloc = self.weights + self.pool

    def step_needs(self, lengths: list[int]) -> int:
        tokens = sum(lengths)
        return (self.act_per_token * tokens
                + int(sum(self.long_seq_bytes_per_token2 * n * n for n in lengths)))

    def run_step(self, lengths: list[int]) -> bool:
        """Allocate one step's activations; False = out of memory."""
        need = self.step_needs(lengths)
        if self.weights + self.non_torch + self.pool + max(need, self.act_reserved) > self.total:
            self.ooms += 1
            return False
        self.act_reserved = max(self.act_reserved, need)
        self.peak_alloc = max(self.peak_alloc, self.weights + self.pool + need)
        return True

    def probe(self) -> dict[str, int]:
        """What ``MemoryProbeExtension`` answers on a card (driver and allocator views)."""
        reserved = self.weights + self.pool + self.act_reserved
        out = {"kind": 1, "used": reserved + self.non_torch, "total": self.total,
               "reserved": reserved, "peak_allocated": self.peak_alloc,
               "weights": self.weights}
        self.peak_alloc = self.weights + self.pool  # reset_peak_memory_stats()
        return out


@dataclass
class _Request:
    tokens: int
    done: asyncio.Future[bool]


class SimEngine:
    """The engine as the replica sees it: ``memory()`` for the follower, ``submit`` for calls."""

    def __init__(self, card: Card, clock) -> None:
        self.card = card
        self.kv = KvUsageTracker(clock=clock)
        self.kv.configure(card.num_blocks, card.block, card.kv_per_token * card.block)
        self.waiting: deque[_Request] = deque()
        self.down_until = 0.0
        self.completed_tokens = 0
        self.failed = 0

    async def memory(self, timeout_s: float, idle: bool = False) -> EngineMemory:
        return EngineMemory(probe=self.card.probe(), kv=self.kv.sample())

    def submit(self, tokens: int) -> asyncio.Future[bool]:
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(_Request(tokens, fut))
        return fut

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if loop.time() < self.down_until or not self.waiting:
                await asyncio.sleep(0.05)
                continue
            batch: list[_Request] = []
            tokens = 0
            while (self.waiting and len(batch) < self.card.max_seqs
                   and tokens + self.waiting[0].tokens <= self.card.max_batched):
                r = self.waiting.popleft()
                batch.append(r)
                tokens += r.tokens
            if not batch:  # a request longer than a step: it runs alone
                batch = [self.waiting.popleft()]
                tokens = batch[0].tokens
            lengths = [r.tokens for r in batch]
            ok = self.card.run_step(lengths)
            if not ok:  # OOM: the engine dies with everything it holds
                for r in [*batch, *self.waiting]:
                    r.done.set_result(False)
                self.failed += len(batch) + len(self.waiting)
                self.waiting.clear()
                self.down_until = loop.time() + self.card.restart_s
                self.kv.observe(0.0, 0, 0)
                continue
            blocks = sum(-(-n // self.card.block) for n in lengths)
            self.kv.observe(min(1.0, blocks / self.card.num_blocks), len(batch),
                            len(self.waiting))
            duration = tokens / self.card.tokens_per_s + sum(n * n for n in lengths) / 2.5e10
            await asyncio.sleep(duration)
            self.kv.observe(0.0, 0, len(self.waiting))
            self.completed_tokens += tokens
            for r in batch:
                r.done.set_result(True)


class ScrapedPrometheus:
    """Plays Ray's metrics agent and Prometheus for the governor: the follower's gauges become
    visible every 10 s (Ray reports user metrics about every 10 s; Prometheus scrapes every 5),
    and the answer is the recording rule's formula (``live_pressure``)."""

    def __init__(self, clock, scrape_s: float = 10.0) -> None:
        self._clock = clock
        self._scrape_s = scrape_s
        self.exported: dict[str, float] = {}
        self._scraped: dict[str, float] = {}
        self._scraped_at: float | None = None

    def set_gauge(self, name: str, value: float, tags: dict[str, str]) -> None:
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
                              s["embedfleet_kv_cache_free_bytes"],
                              s["embedfleet_allocator_cache_free_bytes"])
        return {("node-0", "0"): CardReading(ratio, EPOCH + self._scraped_at)}


@dataclass
class Run:
    governor: bool
    ratios: list[tuple[float, float]] = field(default_factory=list)
    budgets: list[tuple[float, int]] = field(default_factory=list)


async def simulate(governor_on: bool, seed: int, surge: int, ramp_s: float,
                   idle_s: float = 600.0) -> dict:
    loop = asyncio.get_running_loop()
    cfg = load_config(CONFIG)
    m = cfg.models[0]
    ceiling = m.budget_ceiling
    card = Card(max_batched=m.engine.max_num_batched_tokens, util=m.engine.gpu_memory_utilization)
    engine = SimEngine(card, loop.time)
    prom = ScrapedPrometheus(loop.time)
    budget = AdmissionBudget(ceiling.max_sequences, ceiling.max_tokens,
                             max_waiting=100_000, queue_timeout_s=3600, clock=loop.time)
    gov = MemoryGovernor(cfg.model_dump(mode="json"), sink=prom,
                         clock=lambda: EPOCH + loop.time(), readings=prom.readings) \
        if governor_on else None
    follower = LimitsFollower(
        gate=EngineGate(engine), budget=budget, card_tags={"node": "node-0", "device": "0"},
        ceiling=ceiling, interval_s=cfg.governor.interval_s, sink=prom, cpu_card=None,
        peak_window_s=cfg.governor.peak_window_s, clock=loop.time,
        pull_limits=(lambda: gov.limits_for("node-0", "0", ceiling)) if gov else None)
    run = Run(governor_on)

    def record() -> None:
        if follower.reading is not None:
            run.ratios.append((loop.time(), follower.reading.ratio))
        run.budgets.append((loop.time(), budget.limits[1]))

    tasks = [loop.create_task(engine.run()), loop.create_task(prom.scrape_forever()),
             loop.create_task(follower.run(after_tick=record))]

    await asyncio.sleep(idle_s)  # ten idle minutes on the shipped config
    idle = [r for t, r in run.ratios if t <= idle_s]
    idle_budget = min(b for t, b in run.budgets if t <= idle_s) / ceiling.max_tokens

    rng = random.Random(seed)
    sizes = [32768, 32768, 32768, 16384, 8192, 2048]
    results = {"ok": 0, "failed": 0, "rejected": 0}

    async def client(tokens: int) -> None:
        for _ in range(10):  # clients retry failed requests (an OOM fails everything held)
            try:
                async with budget.admit(1, tokens):
                    if await engine.submit(tokens):
                        results["ok"] += 1
                        return
            except Overloaded:
                results["rejected"] += 1
            results["failed"] += 1
            await asyncio.sleep(1.0)

    t0 = loop.time()
    clients = []
    for _ in range(surge):
        # A surge: long inputs arriving faster than one card embeds them (2/s at full rate),
        # building up over ramp_s as load does when a bulk job or a traffic peak starts; with
        # ramp_s = 0 it hits at full rate at once.
        elapsed = loop.time() - t0
        rate = 2.0 * min(1.0, (elapsed + 1.0) / ramp_s) if ramp_s > 0 else 2.0
        await asyncio.sleep(rng.expovariate(rate))
        clients.append(loop.create_task(client(rng.choice(sizes))))
    await asyncio.gather(*clients)
    surge_end = loop.time()
    recovered = None
    while loop.time() - surge_end < 900:
        await asyncio.sleep(1.0)
        if budget.limits == (ceiling.max_sequences, ceiling.max_tokens):
            recovered = loop.time() - surge_end
            break
    for t in tasks:
        t.cancel()
    if gov is not None:
        await gov.stop()
    surge_ratios = [r for t, r in run.ratios if t0 <= t <= surge_end]
    return {"governor": "on" if governor_on else "off",
            "idle_ratio": round(max(idle), 4), "idle_budget_fraction": round(idle_budget, 4),
            "ooms": card.ooms, "requests_ok": results["ok"],
            "request_failures_retried": results["failed"],
            "surge_s": round(surge_end - t0, 1),
            "surge_tokens_per_s": round(engine.completed_tokens / (surge_end - t0), 1),
            "surge_max_ratio": round(max(surge_ratios, default=0.0), 4),
            "min_budget_fraction": round(min(b for _, b in run.budgets) / ceiling.max_tokens,
                                         4),
            "recovered_s": None if recovered is None else round(recovered, 1)}


def _run(on: bool, seed: int, surge: int, ramp_s: float) -> dict[str, Any]:
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(simulate(on, seed, surge, ramp_s))
    finally:
        loop.close()


def run_both(seed: int, surge: int, ramp_s: float = 120.0) -> dict[str, Any]:
    logging.getLogger("embedfleet").setLevel(logging.ERROR)
    off, on = _run(False, seed, surge, ramp_s), _run(True, seed, surge, ramp_s)
    # The worst case, reported beside: the surge at full rate from its first second. A governor
    # that acts on measured pressure cannot prevent an OOM no earlier step hinted at.
    abrupt_off, abrupt_on = _run(False, seed, surge, 0.0), _run(True, seed, surge, 0.0)
    card = Card()
    return {
        "simulation": "one simulated 64 GiB 910B at gpu_memory_utilization 0.95 running "
                      "embedfleet's governor, budget and limits follower; not hardware",
        "card": {"pool_gib": round(card.pool / GiB, 2), "kv_blocks": card.num_blocks,
                 "profiled_activation_gib": round(card.profiled_act / GiB, 2)},
        "idle_ratio": on["idle_ratio"], "idle_budget_fraction": on["idle_budget_fraction"],
        "ooms_without_governor": off["ooms"], "ooms_with_governor": on["ooms"],
        "recovered_s": on["recovered_s"],
        "surge_tokens_per_s_without": off["surge_tokens_per_s"],
        "surge_tokens_per_s_with": on["surge_tokens_per_s"],
        "surge_ramp_s": ramp_s,
        "abrupt_surge": {"ooms_without_governor": abrupt_off["ooms"],
                         "ooms_with_governor": abrupt_on["ooms"],
                         "recovered_s": abrupt_on["recovered_s"]},
        "runs": [off, on, abrupt_off, abrupt_on],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--surge", type=int, default=400, help="requests in the surge")
    p.add_argument("--ramp-s", type=float, default=120.0,
                   help="seconds over which the surge's arrival rate builds up to 2/s")
    p.add_argument("--json", action="store_true", help="print only the JSON (last line)")
    args = p.parse_args(argv)
    report = run_both(args.seed, args.surge, args.ramp_s)
    if not args.json:
        for r in report["runs"]:
            print(f"governor {r['governor']}: {r}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
