"""The governor's signal: memory pressure *outside* the KV pool, not vLLM's reservation.

vLLM takes ``gpu_memory_utilization`` of the card at start-up (0.95 on the 910B profile) and keeps
it: weights, headroom for the activations it profiled, and a KV-cache pool it preallocates to fill
the rest. Filling the pool allocates nothing, so a full pool is not pressure: it is a queue (the
separate ``embedfleet_kv_cache_usage_peak`` series, for saturation and autoscaling). What runs out
on a card is what the plan did not cover: attention workspace (vllm-ascend's profile run skips
attention), fragmentation, runtime growth. So the signal is

    outside  = device used − KV pool − allocator cache that no tensor held and that the
               allocator could hand back (whole free segments), at the interval's peak
    capacity = device total − KV pool          (device total from the runtime: mem_get_info)
    ratio    = outside / capacity

* ratio = 1 is the card out of memory: whatever would be allocated next has nowhere to go.
* The caching allocator keeps freed activation memory mapped. Whole free segments are room: on a
  failed allocation it frees them and retries. Free *pieces* of segments that still hold tensors
  (``inactive_split_bytes``) cannot be handed back: that is fragmentation, and it counts.
  When the allocator had to free and retry (``num_alloc_retries``) or failed (``num_ooms``), the
  card was full at that moment whatever the ratio read: those counters are the governor's hard
  triggers (``governor_law``), reported beside the ratio (``AllocatorCounters``).
* At idle the ratio is (weights + runtime) / (card − KV pool); at the planned operating point it
  is the worst step's peak over the same capacity. A card profile (``card_profile``) holds both.

The same formula runs in Prometheus for every preset (``monitoring/queries.py`` ``live_ratio``,
used by ``monitoring/prometheus/rules.py`` and ``deployments/config/memory_queries.py``): the
replica exports the pool and allocator terms, the device terms come from the replica (the
``embedfleet`` preset) or from npu-exporter / DCGM.

CPU has no card, so the CPU profile models one (``CpuCardModel``) under the same law: the engine
worker's resident memory minus its start-up runtime (Python, torch and libraries, which a card
would not hold), i.e. weights + KV pool + activations, against ``platform.cpu_card_memory_bytes``.
vLLM's CPU worker zero-fills its KV pool at start, so the pool is resident from the first probe
and filling it adds nothing; activations are what rise under load. Peak resident memory over the
interval (``VmHWM``, reset each probe) plays the allocator's peak, and the model keeps the
allocator's counters: a peak beyond the stand-in card's capacity is an allocation a real card
would have failed.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveInt


def live_pressure(used: float, total: float, kv_pool: float, cache_free: float = 0.0) -> float:
    """(used − cache_free − kv_pool) / (total − kv_pool); see the module docstring."""
    capacity = total - kv_pool
    if capacity <= 0:
        return float("inf")
    return max(0.0, used - cache_free - kv_pool) / capacity


def idle_floor(*, weights: int, total: int, kv_pool: int | None) -> float:
    """The lowest the ratio can read at idle, from what a config fixes.

    Idle memory outside the pool is at least the weights; capacity is the card minus the KV pool.
    With the pool fixed (CPU, or ``kv_cache_memory_bytes``) that is weights / (card − pool); sized
    by ``gpu_memory_utilization`` the pool can be anything up to the card, so the bound is
    weights / card. A pool as large as the card leaves no capacity at all (inf)."""
    capacity = total - (kv_pool or 0)
    return weights / capacity if capacity > 0 else float("inf")


class AllocatorCounters(BaseModel):
    """The caching allocator's failure counters since the engine started (cumulative).

    ``torch.npu/torch.cuda.memory_stats()``'s ``num_alloc_retries`` and ``num_ooms``, or the CPU
    card model's. A rise in either between two readings is a hard trigger for the governor."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_alloc_retries: NonNegativeInt = Field(
        0, description="Allocations that succeeded only after the allocator freed its cache "
                       "and retried: the card was full at that moment.")
    num_ooms: NonNegativeInt = Field(
        0, description="Allocations that failed even after the retry: out of memory.")

    def rise_since(self, before: AllocatorCounters | None) -> tuple[int, int]:
        """(retries, OOMs) added since ``before``; a counter that went down is a new engine
        (its counters start again), whose own counts are all new."""
        if before is None:
            return 0, 0
        def d(now: int, then: int) -> int:
            return now - then if now >= then else now
        return (d(self.num_alloc_retries, before.num_alloc_retries),
                d(self.num_ooms, before.num_ooms))


class CardMemoryReading(BaseModel):
    """One reading of a card, as the replica exports it (labels: node, device)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    used_bytes: NonNegativeInt
    """Device memory in use (driver view, at the interval's peak), or the CPU card model's use."""
    total_bytes: PositiveInt
    """The card's memory as the runtime reports it (not the config's nominal size)."""
    kv_pool_bytes: NonNegativeInt
    kv_peak_usage: NonNegativeFloat
    """Highest share of the KV pool in use during the interval: saturation, not pressure."""
    cache_free_bytes: NonNegativeInt = 0
    """Allocator-cached bytes in whole free segments at the interval's peak (0 on CPU)."""
    allocator: AllocatorCounters = AllocatorCounters()

    @property
    def kv_free_bytes(self) -> int:
        return int(self.kv_pool_bytes * (1.0 - min(1.0, self.kv_peak_usage)))

    @property
    def live_bytes(self) -> int:
        """Memory held outside the KV pool (the ratio's numerator)."""
        return max(0, self.used_bytes - self.cache_free_bytes - self.kv_pool_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self.total_bytes - self.kv_pool_bytes

    @property
    def ratio(self) -> float:
        return live_pressure(self.used_bytes, self.total_bytes, self.kv_pool_bytes,
                             self.cache_free_bytes)


class CpuCardModel:
    """The CPU profile's stand-in card: weights + KV pool + activations of the engine worker.

    The first probe (right after the engine started, before any request) fixes the runtime
    baseline = resident − weights − KV pool; later readings are peak resident − baseline. A peak
    past the card's capacity is counted as a real card's allocator would: it retried (freed its
    cache) and still failed."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"CPU card capacity must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.baseline_bytes: int | None = None
        self.num_alloc_retries = 0
        self.num_ooms = 0

    def used(self, resident: int, peak: int, weights: int, kv_pool: int) -> int:
        if self.baseline_bytes is None:
            self.baseline_bytes = max(0, resident - weights - kv_pool)
        used = max(weights + kv_pool, peak - self.baseline_bytes)
        if used > self.capacity_bytes:
            self.num_alloc_retries += 1
            self.num_ooms += 1
        return used

    @property
    def counters(self) -> AllocatorCounters:
        return AllocatorCounters(num_alloc_retries=self.num_alloc_retries,
                                 num_ooms=self.num_ooms)


def reading_from_probe(probe: dict[str, int], kv_pool_bytes: int, kv_peak_usage: float,
                       cpu_card: CpuCardModel | None) -> CardMemoryReading:
    """A reading from the worker's raw probe (``vllm_api.MemoryProbeExtension``)."""
    if probe["kind"] == 0:  # CPU: resident memory of the worker process
        if cpu_card is None:
            raise ValueError("a CPU probe needs the CPU card model (platform.kind: cpu)")
        used = cpu_card.used(probe["used"], probe["peak"], probe["weights"], kv_pool_bytes)
        return CardMemoryReading(used_bytes=used, total_bytes=cpu_card.capacity_bytes,
                                 kv_pool_bytes=kv_pool_bytes, kv_peak_usage=kv_peak_usage,
                                 allocator=cpu_card.counters)
    # The driver's used is read once; the allocator's reserved peak covers a spike between
    # (cache it handed back since). Of what it reserved, whole free segments are room; free
    # pieces of segments that hold tensors are fragmentation and count as held.
    reserved = max(probe["reserved"], probe.get("reserved_peak", 0))
    used = probe["used"] + reserved - probe["reserved"]
    held = probe["peak_allocated"] + probe.get("inactive_split_peak", 0)
    cache_free = max(0, reserved - held)
    return CardMemoryReading(used_bytes=used, total_bytes=probe["total"],
                             kv_pool_bytes=kv_pool_bytes, kv_peak_usage=kv_peak_usage,
                             cache_free_bytes=cache_free,
                             allocator=AllocatorCounters(
                                 num_alloc_retries=probe.get("num_alloc_retries", 0),
                                 num_ooms=probe.get("num_ooms", 0)))


def total_mismatch(runtime_total: int, configured: int | None) -> str | None:
    """The runtime's card total against the config's ``card_memory_bytes`` (a cross-check only:
    the runtime's is used). Runtimes report less than the data sheet (a 64 GB 910B reports
    ~60.96 GiB: vllm-ascend #4404); more than configured, or under 85% of it, is another card."""
    if configured is None:
        return None
    if runtime_total > configured or runtime_total < 0.85 * configured:
        return (f"the runtime reports {runtime_total} bytes on this card, the config says "
                f"platform.card_memory_bytes={configured}: the governor uses the runtime's")
    return None


def signal_floor_problems(cfg: Any) -> list[str]:
    """Models whose card's live memory ratio could not fall below ``governor.params.high`` at
    idle: a governor would hold them at their floor forever (``card_memory.idle_floor``)."""
    from ..common.fingerprint import weights_bytes

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
