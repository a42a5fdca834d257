"""Every embedfleet metric, defined once.

Metrics are Ray user metrics (``ray.util.metrics``): Ray's metrics agent exports them to Prometheus
with a ``ray_`` prefix, so ``embedfleet_requests_total`` is scraped as
``ray_embedfleet_requests_total``. Rules and dashboards use the exported names; a test checks that
every name they use is declared here (``EXPORTED_NAMES``).

Label values are bounded: ``model`` comes from the config, ``api`` and ``status_code`` from the small
sets below, ``outcome`` from its two values, ``node`` / ``device`` from the cluster's cards.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

MetricKind = Literal["counter", "gauge", "histogram"]

# Durations are geometric (2 ms .. ~65 s); sizes are powers of two.
LATENCY_BUCKETS_S: tuple[float, ...] = tuple(0.002 * 2**i for i in range(16))
BATCH_SIZE_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(12))
TOKENS_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(4, 17))

# embed_v2: Cohere's /v2/embed; batch: the Serve-handle API
APIS = ("embeddings", "embed", "embed_v2", "models", "tokenize", "batch")


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: MetricKind
    description: str
    tags: tuple[str, ...]
    buckets: tuple[float, ...] | None = None

    @property
    def exported(self) -> tuple[str, ...]:
        """Names Prometheus sees after Ray's export.

        Checked against a scrape of Ray 2.60's metrics agent (OpenTelemetry exporter): every name
        gets the ``ray_`` prefix; a counter gets ``_total`` appended unless its name already ends
        in ``_total`` (``x`` -> ``ray_x_total``, ``x_total`` -> ``ray_x_total``); a histogram is
        ``_bucket`` / ``_count`` / ``_sum``; a gauge keeps its name.
        """
        base = f"ray_{self.name}"
        if self.kind == "histogram":
            return (f"{base}_bucket", f"{base}_count", f"{base}_sum")
        if self.kind == "counter" and not base.endswith("_total"):
            return (f"{base}_total",)
        return (base,)


SPECS: tuple[MetricSpec, ...] = (
    # Router: one request = one HTTP call.
    MetricSpec("embedfleet_requests_total", "counter",
               "HTTP requests answered by the router, by model, API and status code.",
               ("model", "api", "status_code")),
    MetricSpec("embedfleet_request_latency_seconds", "histogram",
               "Router latency from request received to response built.",
               ("model", "api"), LATENCY_BUCKETS_S),
    MetricSpec("embedfleet_inputs_total", "counter",
               "Inputs (texts or token lists) embedded.", ("model",)),
    MetricSpec("embedfleet_input_tokens_total", "counter",
               "Prompt tokens embedded (what `usage` reports).", ("model",)),
    MetricSpec("embedfleet_affinity_routed_total", "counter",
               "Calls with a prefix-affinity key, by where they went: the key's preferred replica, "
               "or another (spilled: the preferred one was over its bounded load or full).",
               ("model", "outcome")),
    MetricSpec("embedfleet_overload_rejections_total", "counter",
               "Requests refused before any work: 429 when a model's queue or budget was full, "
               "503 at once when it has no ready replica and none starting "
               "(reason=no_ready_replica).",
               ("model", "reason")),
    # Engine replica: one per card.
    MetricSpec("embedfleet_engine_batch_size", "histogram",
               "Inputs per call into the engine replica.", ("model",), BATCH_SIZE_BUCKETS),
    MetricSpec("embedfleet_engine_latency_seconds", "histogram",
               "Time inside the engine replica per call (tokenize, queue for budget, embed).",
               ("model",), LATENCY_BUCKETS_S),
    MetricSpec("embedfleet_replica_ready", "gauge",
               "1 while this replica's engine is up and its health check passes.",
               ("model", "node", "device")),
    MetricSpec("embedfleet_inflight_sequences", "gauge",
               "Sequences inside the engine on this card.", ("model", "node", "device")),
    MetricSpec("embedfleet_inflight_tokens", "gauge",
               "Tokens inside the engine on this card.", ("model", "node", "device")),
    MetricSpec("embedfleet_budget_sequences", "gauge",
               "Admission budget: max sequences in flight on this card.",
               ("model", "node", "device")),
    MetricSpec("embedfleet_budget_tokens", "gauge",
               "Admission budget: max tokens in flight on this card.", ("model", "node", "device")),
    MetricSpec("embedfleet_card_memory_used_bytes", "gauge",
               "Card memory in use as the driver sees it (on CPU: the engine worker's peak "
               "resident memory minus its start-up runtime).", ("node", "device")),
    MetricSpec("embedfleet_card_memory_total_bytes", "gauge",
               "Card memory capacity (configured capacity on CPU).", ("node", "device")),
    MetricSpec("embedfleet_kv_cache_pool_bytes", "gauge",
               "Bytes of the engine's KV-cache pool, reserved at start-up.", ("node", "device")),
    MetricSpec("embedfleet_kv_cache_usage_peak", "gauge",
               "Highest share of the KV pool in use over the last interval (in-step).",
               ("node", "device")),
    MetricSpec("embedfleet_kv_cache_free_bytes", "gauge",
               "Free part of the KV pool at the interval's peak: reserved, never pressure.",
               ("node", "device")),
    MetricSpec("embedfleet_allocator_cache_free_bytes", "gauge",
               "Memory the device allocator caches in whole free segments at the interval's "
               "peak: room it hands back on demand, not pressure (fragmentation is not in it).",
               ("node", "device")),
    MetricSpec("embedfleet_allocator_alloc_retries", "gauge",
               "The engine's allocator: allocations that needed its cache freed and a retry, "
               "since the engine started (a rise cuts the card's budget).", ("node", "device")),
    MetricSpec("embedfleet_allocator_ooms", "gauge",
               "The engine's allocator: allocations that failed even after a retry, since the "
               "engine started (a rise cuts the card's budget).", ("node", "device")),
    MetricSpec("embedfleet_card_memory_live_ratio", "gauge",
               "The replica's own reading of the governor's signal: memory outside the KV pool "
               "over the card minus the pool.", ("node", "device")),
    MetricSpec("embedfleet_prompt_tokens_total", "counter",
               "Prompt tokens sent into the engine on this card.", ("model", "node", "device")),
    MetricSpec("embedfleet_prefix_cache_hit_tokens_total", "counter",
               "Prompt tokens served from vLLM's prefix cache (num_cached_tokens) on this card.",
               ("model", "node", "device")),
    MetricSpec("embedfleet_prefix_cache_enabled", "gauge",
               "1 when prefix caching is on for the model's replicas.", ("model",)),
    MetricSpec("embedfleet_canary_last_cosine", "gauge",
               "Lowest cosine between cache-hit and cold vectors in the last canary run.",
               ("model",)),
    MetricSpec("embedfleet_canary_floor", "gauge",
               "Cosine the last canary run had to reach to pass (calibrated from two cold runs).",
               ("model",)),
    MetricSpec("embedfleet_canary_failures_total", "counter",
               "Canary runs whose cache-hit vectors differed from cold ones.", ("model",)),
    MetricSpec("embedfleet_canary_inconclusive_total", "counter",
               "Canary runs that proved nothing: no cache hit, or a cosine between the failure "
               "threshold and the floor.", ("model",)),
    MetricSpec("embedfleet_canary_verdict", "gauge",
               "1 for the last canary run's verdict (passed, failed, inconclusive), else 0.",
               ("model", "verdict")),
    MetricSpec("embedfleet_engine_swaps_total", "counter",
               "Engine replacements after a failed canary, by outcome (ok, failed).",
               ("model", "outcome")),
    MetricSpec("embedfleet_engine_restarts_total", "counter",
               "Engines restarted in place after one died in a step (its calls run again on the "
               "new one), by outcome (ok, failed).", ("model", "outcome")),
    MetricSpec("embedfleet_truncated_inputs_total", "counter",
               "Inputs truncated by the long-input policy.", ("model",)),
    MetricSpec("embedfleet_dropped_tokens_total", "counter",
               "Tokens dropped by truncation.", ("model",)),
    MetricSpec("embedfleet_chunks_total", "counter",
               "Chunks embedded for inputs split by the long-input policy.", ("model",)),
    # Memory governor: one replica, no card.
    MetricSpec("embedfleet_governor_memory_ratio", "gauge",
               "Card memory ratio the governor last read from Prometheus.", ("node", "device")),
    MetricSpec("embedfleet_governor_limit_tokens", "gauge",
               "Token budget the governor set for the card.", ("node", "device")),
    MetricSpec("embedfleet_governor_limit_sequences", "gauge",
               "Sequence budget the governor set for the card.", ("node", "device")),
    MetricSpec("embedfleet_governor_high", "gauge",
               "The ratio at or above which the governor cuts this card (its model's card "
               "profile, or the configured band): the card-memory alert's threshold.",
               ("node", "device")),
    MetricSpec("embedfleet_governor_low", "gauge",
               "The ratio at or below which the governor grows this card's budget back.",
               ("node", "device")),
    MetricSpec("embedfleet_governor_stale", "gauge",
               "1 when the governor holds last limits because Prometheus is unreachable or stale.",
               ()),
)

BY_NAME: dict[str, MetricSpec] = {s.name: s for s in SPECS}
EXPORTED_NAMES: frozenset[str] = frozenset(n for s in SPECS for n in s.exported)


@functools.cache
def get(name: str):
    """The live Ray metric for ``name`` (created once per process, in a Ray worker)."""
    from ray.util import metrics as ray_metrics

    spec = BY_NAME[name]
    if spec.kind == "counter":
        return ray_metrics.Counter(spec.name, spec.description, tag_keys=spec.tags)
    if spec.kind == "gauge":
        return ray_metrics.Gauge(spec.name, spec.description, tag_keys=spec.tags)
    return ray_metrics.Histogram(spec.name, spec.description, boundaries=list(spec.buckets or ()),
                                 tag_keys=spec.tags)


class Batched:
    """Request-path metrics, recorded locally and flushed to Ray once per ``flush()``.

    A Ray metric call costs tens of microseconds of the request's own CPU; a request used to make
    ten of them. Counters are summed per (name, tags) and histogram observations kept in a list,
    then sent by a background task every couple of seconds (``flush_forever``), off the path.
    """

    def __init__(self) -> None:
        self._counts: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._observed: list[tuple[str, float, tuple[tuple[str, str], ...]]] = []

    def inc(self, name: str, value: float, tags: dict[str, str]) -> None:
        key = (name, tuple(sorted(tags.items())))
        self._counts[key] = self._counts.get(key, 0.0) + value

    def observe(self, name: str, value: float, tags: dict[str, str]) -> None:
        self._observed.append((name, value, tuple(sorted(tags.items()))))

    def flush(self) -> None:
        counts, self._counts = self._counts, {}
        observed, self._observed = self._observed, []
        for (name, tags), value in counts.items():
            if value:
                get(name).inc(value, tags=dict(tags))
        for name, value, tags in observed:
            get(name).observe(value, tags=dict(tags))

    async def flush_forever(self, every_s: float = 2.0) -> None:
        import asyncio

        while True:
            await asyncio.sleep(every_s)
            try:
                self.flush()
            except Exception:  # a metrics failure must never reach the request path
                pass
