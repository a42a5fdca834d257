"""The governor's signal: a card's *live* memory pressure, not vLLM's reservation.

vLLM takes ``gpu_memory_utilization`` of the card at start-up (0.95 on the 910B profile) and keeps
it: weights, a KV-cache pool sized to fill the rest, and headroom for the activations it profiled.
The device's used/total therefore sits at ~0.95 while the card is idle, and a governor acting on
it would cut budgets to the floor and never raise them. So the signal is

    live     = device used − free part of the KV pool − memory the allocator caches but no
               tensor held at the interval's peak
    capacity = device total − free part of the KV pool
    ratio    = live / capacity

* The free part of the KV pool is held by vLLM and can never serve anything else: it is neither
  pressure nor room. Blocks in use count (they follow admitted work), taken at their peak over the
  interval so a long prefill's spike is seen (``kv_usage.KvUsageTracker``).
* The caching allocator keeps freed activation memory mapped; it is room for the next step, not
  work. Its peak *allocated* bytes since the last probe (then reset) are what the work used.
* ratio = 1 is the card out of memory: whatever would be allocated next has nowhere to go. At idle
  the ratio is (weights + runtime) / (card − KV pool): ~0.7 for Qwen3-Embedding-8B on a 64 GB
  910B at 0.95 (``benchmarks/governor_sim.py``), ~0.03 for MiniLM on the CPU profile.

The same formula runs in Prometheus for every preset (``monitoring/prometheus/rules.py`` and
``deployments/control/memory_queries.py``): the replica exports the KV and allocator terms, the device terms
come from the replica (the ``embedfleet`` preset) or from npu-exporter / DCGM.

CPU has no card, so the CPU profile models one: the engine worker's resident memory minus its
start-up runtime (Python, torch and libraries, which a card would not hold), i.e. weights + KV
pool + activations, against ``platform.cpu_card_memory_bytes``. Peak resident memory over the
interval (``VmHWM``, reset each probe) plays the allocator's peak.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, NonNegativeFloat, NonNegativeInt, PositiveInt


def live_pressure(used: float, total: float, kv_free: float, cache_free: float = 0.0) -> float:
    """(used − cache_free − kv_free) / (total − kv_free); see the module docstring."""
    capacity = total - kv_free
    if capacity <= 0:
        return float("inf")
    return max(0.0, used - cache_free - kv_free) / capacity


def idle_floor(*, weights: int, total: int, kv_pool: int | None) -> float:
    """The lowest the live ratio can read at idle, from what a config fixes.

    Idle live memory is at least the weights; capacity is the card minus the KV pool. With the
    pool fixed (CPU, or ``kv_cache_memory_bytes``) that is weights / (card − pool); sized by
    ``gpu_memory_utilization`` the pool can be anything up to the card, so the bound is
    weights / card. A pool as large as the card leaves no capacity at all (inf)."""
    capacity = total - (kv_pool or 0)
    return weights / capacity if capacity > 0 else float("inf")


class CardMemoryReading(BaseModel):
    """One reading of a card, as the replica exports it (labels: node, device)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    used_bytes: NonNegativeInt
    """Device memory in use (driver view), or the CPU card model's use."""
    total_bytes: PositiveInt
    kv_pool_bytes: NonNegativeInt
    kv_peak_usage: NonNegativeFloat
    """Highest share of the KV pool in use during the interval."""
    cache_free_bytes: NonNegativeInt = 0
    """Allocator-cached bytes no tensor held at the interval's peak (0 on CPU)."""

    @property
    def kv_free_bytes(self) -> int:
        return int(self.kv_pool_bytes * (1.0 - min(1.0, self.kv_peak_usage)))

    @property
    def live_bytes(self) -> int:
        return max(0, self.used_bytes - self.cache_free_bytes - self.kv_free_bytes)

    @property
    def ratio(self) -> float:
        return live_pressure(self.used_bytes, self.total_bytes, self.kv_free_bytes,
                             self.cache_free_bytes)


class CpuCardModel:
    """The CPU profile's stand-in card: weights + KV pool + activations of the engine worker.

    The first probe (right after the engine started, before any request) fixes the runtime
    baseline = resident − weights − KV pool; later readings are peak resident − baseline."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"CPU card capacity must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.baseline_bytes: int | None = None

    def used(self, resident: int, peak: int, weights: int, kv_pool: int) -> int:
        if self.baseline_bytes is None:
            self.baseline_bytes = max(0, resident - weights - kv_pool)
        return max(weights + kv_pool, peak - self.baseline_bytes)


def reading_from_probe(probe: dict[str, int], kv_pool_bytes: int, kv_peak_usage: float,
                       cpu_card: CpuCardModel | None) -> CardMemoryReading:
    """A reading from the worker's raw probe (``vllm_api.MemoryProbeExtension``)."""
    if probe["kind"] == 0:  # CPU: resident memory of the worker process
        if cpu_card is None:
            raise ValueError("a CPU probe needs the CPU card model (platform.kind: cpu)")
        used = cpu_card.used(probe["used"], probe["peak"], probe["weights"], kv_pool_bytes)
        return CardMemoryReading(used_bytes=used, total_bytes=cpu_card.capacity_bytes,
                                 kv_pool_bytes=kv_pool_bytes, kv_peak_usage=kv_peak_usage)
    cache_free = max(0, probe["reserved"] - probe["peak_allocated"])
    return CardMemoryReading(used_bytes=probe["used"], total_bytes=probe["total"],
                             kv_pool_bytes=kv_pool_bytes, kv_peak_usage=kv_peak_usage,
                             cache_free_bytes=cache_free)


def signal_floor_problems(cfg: Any) -> list[str]:
    """Models whose card's live memory ratio could not fall below ``governor.params.high`` at
    idle: a governor would hold them at their floor forever (``card_memory.idle_floor``)."""
    from embedfleet.deployments.request_path.fingerprint import weights_bytes

    high = cfg.governor.params.high
    out = []
    for i, m in enumerate(cfg.models):
        weights = weights_bytes(m.source)
        if weights is None:
            continue  # not on this machine: the replica checks its real idle reading at start
        if cfg.platform.kind == "cpu":
            total = cfg.platform.cpu_card_memory_bytes
            pool = cfg.engine_kwargs_pool_bytes(m)
        else:
            total, pool = cfg.platform.card_memory_bytes, m.engine.kv_cache_memory_bytes
            if total is None:
                continue
        floor = idle_floor(weights=weights, total=total, kv_pool=pool)
        if floor >= high:
            where = ("platform.cpu_card_memory_bytes" if cfg.platform.kind == "cpu"
                     else "platform.card_memory_bytes")
            out.append(f"models[{i}] ({m.name!r}): the live memory ratio cannot fall below "
                       f"{floor:.3f} at idle (weights {weights} B, KV pool {pool or 0} B, "
                       f"{where}={total}), not below governor.params.high={high}: the governor "
                       "would hold this card's budget at its floor forever")
    return out
