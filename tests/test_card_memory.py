"""The governor's signal: memory pressure outside the KV pool, from the engine's probe.

The formula is checked at its boundaries against what a 910B at 0.95 reserves (a full KV pool
alone moves nothing); the allocator's terms (releasable cache, fragmentation, the retry and OOM
counters); the CPU card model and the worker-side probe against real processes (resident
memory, its peak and the ``clear_refs`` reset)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from embedfleet.deployments.engine.card_memory import (AllocatorCounters, CardMemoryReading,
                                                       CpuCardModel, idle_floor, live_pressure,
                                                       reading_from_probe, total_mismatch)
from embedfleet.deployments.engine.card_profile import load_profile, shipped_profile_path
from embedfleet.deployments.engine.kv_usage import KvUsageTracker

GiB = 1 << 30
MB = 1 << 20


def test_reservation_and_a_full_pool_are_not_pressure():
    # The shipped 910B profile (assumptions): weights + runtime outside a preallocated pool; the
    # profile run's activations cached by the allocator (whole free segments) at idle.
    p = load_profile(shipped_profile_path("ascend-910b-qwen3-embedding-8b"))
    cached = p.worst_step_peak_bytes - p.idle_outside_pool_bytes
    used = p.idle_outside_pool_bytes + p.kv_pool_bytes + cached
    assert used / p.card_total_bytes > 0.94  # what the driver (npu-smi, mem_get_info) reports
    idle = live_pressure(used, p.card_total_bytes, kv_pool=p.kv_pool_bytes, cache_free=cached)
    assert idle == pytest.approx(p.idle_ratio) and idle < 0.8
    # The pool fills (queued work holds its blocks): the same reading, whatever the fill.
    readings = [CardMemoryReading(used_bytes=used, total_bytes=p.card_total_bytes,
                                  kv_pool_bytes=p.kv_pool_bytes, kv_peak_usage=fill,
                                  cache_free_bytes=cached) for fill in (0.0, 0.5, 1.0)]
    assert {r.ratio for r in readings} == {idle}
    assert [r.kv_free_bytes for r in readings][-1] == 0  # saturation is still there to read
    # A worst step holds what it planned: the operating point, below the profile's cut.
    op = live_pressure(used, p.card_total_bytes, kv_pool=p.kv_pool_bytes, cache_free=0)
    assert op == pytest.approx(p.operating_point_ratio) and op < p.safe_ratio


def test_ratio_is_one_exactly_when_the_card_is_full():
    pool = 30 * GiB
    assert live_pressure(64 * GiB, 64 * GiB, kv_pool=pool) == pytest.approx(1.0)
    # more held outside the pool with everything else equal: higher pressure
    lo = live_pressure(50 * GiB, 64 * GiB, kv_pool=pool, cache_free=4 * GiB)
    hi = live_pressure(50 * GiB, 64 * GiB, kv_pool=pool, cache_free=2 * GiB)
    assert lo < hi < 1.0
    assert live_pressure(10, 10, kv_pool=10) == float("inf")  # no capacity left at all


def test_reading_terms_and_ratio():
    r = CardMemoryReading(used_bytes=60 * GiB, total_bytes=64 * GiB, kv_pool_bytes=40 * GiB,
                          kv_peak_usage=0.25, cache_free_bytes=2 * GiB)
    assert r.kv_free_bytes == 30 * GiB
    assert r.live_bytes == 18 * GiB and r.capacity_bytes == 24 * GiB
    assert r.ratio == pytest.approx(18 / 24)


def test_device_probe_counts_fragmentation_not_the_releasable_cache():
    probe = {"kind": 1, "used": 62 * GiB, "total": 64 * GiB, "reserved": 59 * GiB,
             "reserved_peak": 60 * GiB, "peak_allocated": 55 * GiB, "inactive_split_peak": 0,
             "num_alloc_retries": 3, "num_ooms": 1, "weights": 14 * GiB}
    r = reading_from_probe(probe, kv_pool_bytes=40 * GiB, kv_peak_usage=0.0, cpu_card=None)
    # 1 GiB the allocator handed back since its peak is added back to the driver's reading;
    # of the 60 GiB it reserved at its peak, 5 were whole free segments.
    assert r.used_bytes == 63 * GiB and r.cache_free_bytes == 5 * GiB
    assert r.ratio == pytest.approx((63 - 5 - 40) / (64 - 40))
    assert r.allocator == AllocatorCounters(num_alloc_retries=3, num_ooms=1)
    # Free pieces of segments that hold tensors cannot be handed back: they count.
    frag = reading_from_probe({**probe, "inactive_split_peak": 2 * GiB}, 40 * GiB, 0.0, None)
    assert frag.cache_free_bytes == 3 * GiB and frag.ratio > r.ratio
    # An older probe (no peak, no fragmentation, no counters): what it has.
    old = {k: v for k, v in probe.items()
           if k not in ("reserved_peak", "inactive_split_peak", "num_alloc_retries", "num_ooms")}
    r_old = reading_from_probe(old, 40 * GiB, 0.0, None)
    assert r_old.used_bytes == 62 * GiB and r_old.cache_free_bytes == 4 * GiB
    assert r_old.allocator == AllocatorCounters()


def test_allocator_counter_rises_and_a_new_engine():
    now = AllocatorCounters(num_alloc_retries=3, num_ooms=1)
    assert now.rise_since(None) == (0, 0)  # the first reading is the baseline
    assert now.rise_since(AllocatorCounters(num_alloc_retries=1, num_ooms=1)) == (2, 0)
    # A new engine starts from 0: what it counted is all new.
    assert now.rise_since(AllocatorCounters(num_alloc_retries=5, num_ooms=2)) == (3, 1)


def test_cpu_card_model_follows_the_same_law_and_counts_overflows():
    card = CpuCardModel(2 * GiB)
    first = {"kind": 0, "used": 1500 * MB, "peak": 1500 * MB, "weights": 90 * MB}
    r0 = reading_from_probe(first, kv_pool_bytes=400 * MB, kv_peak_usage=0.0, cpu_card=card)
    assert card.baseline_bytes == 1010 * MB  # resident - weights - pool: Python, torch, libs
    assert r0.used_bytes == 490 * MB and r0.ratio == pytest.approx(90 / (2048 - 400))
    # Under load the activations rise; the pool (zero-filled at start) does not, full or not.
    busy = {"kind": 0, "used": 1510 * MB, "peak": 2300 * MB, "weights": 90 * MB}
    r1 = reading_from_probe(busy, kv_pool_bytes=400 * MB, kv_peak_usage=1.0, cpu_card=card)
    r1_empty = reading_from_probe(busy, kv_pool_bytes=400 * MB, kv_peak_usage=0.0,
                                  cpu_card=card)
    assert r1.used_bytes == 1290 * MB and r1.ratio == pytest.approx(890 / 1648)
    assert r1_empty.ratio == r1.ratio
    assert r1.allocator == AllocatorCounters()
    # Past the stand-in card's capacity a real card's allocator would have retried and failed.
    over = {"kind": 0, "used": 1510 * MB, "peak": 3100 * MB, "weights": 90 * MB}
    r2 = reading_from_probe(over, kv_pool_bytes=400 * MB, kv_peak_usage=1.0, cpu_card=card)
    assert r2.ratio > 1 and r2.allocator == AllocatorCounters(num_alloc_retries=1, num_ooms=1)
    with pytest.raises(ValueError):
        reading_from_probe(first, kv_pool_bytes=0, kv_peak_usage=0.0, cpu_card=None)
    with pytest.raises(ValueError):
        CpuCardModel(0)


def test_runtime_total_cross_checks_the_config():
    assert total_mismatch(65452113920, 64 * GiB) is None  # a 64 GB 910B: vllm-ascend #4404
    assert total_mismatch(65452113920, None) is None
    assert "runtime reports" in total_mismatch(32 * GiB, 64 * GiB)  # another card
    assert "runtime reports" in total_mismatch(65 * GiB, 64 * GiB)


def test_idle_floor_bounds():
    assert idle_floor(weights=90 * MB, total=4 * GiB, kv_pool=128 * MB) < 0.03
    assert idle_floor(weights=15 * GiB, total=64 * GiB, kv_pool=None) == pytest.approx(15 / 64)
    assert idle_floor(weights=1, total=GiB, kv_pool=GiB) == float("inf")


def test_kv_tracker_adds_back_blocks_of_requests_that_finished_in_the_step():
    t = [100.0]
    kv = KvUsageTracker(window_s=15, clock=lambda: t[0])
    kv.configure(num_blocks=100, block_size=32, block_bytes=1 << 20)
    # vLLM reports usage after freeing: 0.0; the step held 65 requests of 252 tokens.
    usage = kv.in_step_usage(0.0, [(252, 0)] * 65)
    assert usage == pytest.approx(min(1.0, 65 * 8 / 100))
    # shared cached prefixes count once: 10 requests of 300 tokens, 256 of them cached
    assert kv.in_step_usage(0.05, [(300, 256)] * 10) == pytest.approx(0.05 + (10 * 2 + 8) / 100)
    kv.observe(0.3, 4, 7)
    t[0] += 5
    kv.observe(0.1, 1, 0)
    s = kv.sample()
    assert (s.peak_usage, s.running, s.waiting, s.pool_bytes) == (0.3, 1, 0, 100 << 20)
    t[0] += 20  # the spike left the window
    assert kv.sample().peak_usage == 0.0


PROBE_CHILD = textwrap.dedent("""
    import sys
    from embedfleet.deployments.engine.vllm_api import _rss_and_peak
    rss0, peak0 = _rss_and_peak()
    block = bytearray(300 << 20)          # touched: resident
    for i in range(0, len(block), 4096):
        block[i] = 1
    del block                             # freed: back to the OS (a large mmap)
    rss1, peak1 = _rss_and_peak()         # peak saw it, then reset
    rss2, peak2 = _rss_and_peak()
    print(rss0, peak0, rss1, peak1, rss2, peak2)
""")


# The two probes below in a process on glibc's malloc, whatever the caller preloads: what they
# check (a freed mmap is gone, a freed heap stays resident) is glibc's. Under tcmalloc (a CPU
# replica's engine) the idle release is tests/test_cpu_card_threads.py's.
GLIBC = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def test_worker_probe_sees_a_freed_spike_once_then_resets():
    out = subprocess.run([sys.executable, "-c", PROBE_CHILD], capture_output=True, text=True,
                         env=GLIBC, check=True).stdout.split()
    rss0, peak0, rss1, peak1, rss2, peak2 = map(int, out)
    assert peak1 - rss1 >= 250 * MB   # the freed 300 MB spike shows in the peak...
    assert rss1 - rss0 < 50 * MB      # ...not in resident memory after it
    assert peak2 - rss2 < 20 * MB     # and the reset forgot it


TRIM_CHILD = textwrap.dedent("""
    import types
    import torch
    from embedfleet.deployments.engine.vllm_api import MemoryProbeExtension
    worker = types.SimpleNamespace(device="cpu",
                                   model_runner=types.SimpleNamespace(model=torch.nn.Linear(64, 64)))
    probe = lambda idle: MemoryProbeExtension.embedfleet_memory_probe(worker, idle)
    base = probe(False)
    chunks = [bytearray(100_000) for _ in range(2500)]   # 250 MB on the heap (below mmap size)
    for c in chunks:
        c[::4096] = b"x" * len(c[::4096])
    pin = bytearray(1000)                                # keeps the heap's top in use
    del chunks                                           # freed, but glibc keeps it resident
    busy = probe(False)
    idle = probe(True)
    print(base["used"], busy["used"], idle["used"], idle["peak"], base["weights"], base["kind"])
""")


def test_idle_probe_hands_cached_heap_memory_back():
    out = subprocess.run([sys.executable, "-c", TRIM_CHILD], capture_output=True, text=True,
                         env=GLIBC, check=True).stdout.split()
    base, busy, idle, idle_peak, weights, kind = map(int, out)
    assert kind == 0 and weights == (64 * 64 + 64) * 4
    assert busy - base >= 200 * MB    # freed heap memory stays resident: glibc's cache
    assert idle - base < 50 * MB      # the idle probe trimmed it back
    assert idle_peak == idle          # and reports no stale peak from before the trim
