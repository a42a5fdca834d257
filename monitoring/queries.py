"""PromQL that other code runs, and the names of embedfleet's recording rules.

Recording rules are named ``level:metric:operation`` (level = the labels the result keeps). Code
outside ``monitoring`` queries these names rather than writing its own PromQL, so the governor,
the alert and the dashboard all read one definition of, say, "card memory ratio".
"""

from __future__ import annotations

from . import thresholds

# Per model (label: model).
REQUESTS_RATE = "model:embedfleet_requests:rate5m"
# Per model, API and status code: the "errors by code" view keeps the code.
REQUESTS_BY_CODE_RATE = "model_api_code:embedfleet_requests:rate5m"
ERRORS_RATIO = "model:embedfleet_errors:ratio_rate5m"
LATENCY_P50 = "model:embedfleet_request_latency_seconds:p50_5m"
LATENCY_P99 = "model:embedfleet_request_latency_seconds:p99_5m"
INPUT_TOKENS_RATE = "model:embedfleet_input_tokens:rate5m"
OVERLOAD_REJECTIONS_RATE = "model_reason:embedfleet_overload_rejections:rate5m"
PREFIX_CACHE_HIT_RATIO = "model:embedfleet_prefix_cache_hit_tokens:ratio_rate5m"
REPLICAS_READY = "model:embedfleet_replica_ready:sum"
# Per model and outcome (preferred, spilled): prefix-affinity routing's calls.
AFFINITY_ROUTED_RATE = "model_outcome:embedfleet_affinity_routed:rate5m"

# Per card (labels: node, device).
CARD_MEMORY_RATIO = "card:embedfleet_memory:ratio"
"""Card memory pressure outside the KV pool per (node, device) (``live_ratio``; not the engine's
reservation, not the pool's fill).
The memory governor runs exactly this query (an instant query of the recording rule) and the
card-memory alert fires on it."""
BUDGET_FILL_RATIO = "card:embedfleet_budget_fill:ratio"
"""In-flight / budget for the tighter of the two admission budgets (tokens, sequences)."""
CARD_PREFIX_CACHE_HIT_RATIO = "card:embedfleet_prefix_cache_hit_tokens:ratio_rate5m"
"""Per (model, node, device): prompt tokens served from that replica's prefix cache. With
prefix-affinity routing each replica keeps its own keys' prefixes warm, so this stays high on
every card; a card far below the others is getting keys it does not own."""


def series(metric: str, *matchers: str) -> str:
    """``metric{<embedfleet selector>, *matchers}``: a raw embedfleet series, correctly selected.

    >>> series("ray_embedfleet_replica_ready", 'model="m"')
    'ray_embedfleet_replica_ready{job="ray", model="m"}'
    """
    return f"{metric}{{{', '.join((thresholds.SELECTOR, *matchers))}}}"



def per_card(expr: str) -> str:
    """``max by (node, device)``: a replica restarted on the same card is counted once."""
    return f"max by (node, device) ({expr})"


def ray_gauge(metric: str) -> str:
    """A Ray-exported gauge, its last sample within ``RAY_GAUGE_LOOKBACK`` (see thresholds)."""
    return f"last_over_time({series(metric)}[{thresholds.RAY_GAUGE_LOOKBACK}])"


def live_ratio(used: str, total: str) -> str:
    """The governor's signal in PromQL, the same formula as ``card_memory.live_pressure``:

        (used − allocator cache free − KV pool) / (total − KV pool)

    i.e. memory outside the KV pool over what the pool leaves: the pool is preallocated, so
    filling it is not pressure (its use is the separate ``kv_cache_usage_peak`` series).
    ``used`` and ``total`` are per-card byte vectors labelled exactly (node, device), on the
    runtime's scale: from the replicas (the ``embedfleet`` preset) or from npu-exporter / DCGM
    put on that scale (``memory_queries.exporter_query``). The pool and allocator terms always
    come from the replicas. A card whose replica reports no pool term has no result (the
    governor holds it stale) rather than a raw ratio saturated by vLLM's reservation."""
    # The replica's terms (``embedfleet.deployments.engine.card_memory``), exported per card.
    pool = per_card(ray_gauge("ray_embedfleet_kv_cache_pool_bytes"))
    cache = per_card(ray_gauge("ray_embedfleet_allocator_cache_free_bytes"))
    return (f"clamp_min(\n  {used}\n  - on (node, device) {cache}\n"
            f"  - on (node, device) {pool},\n  0)\n"
            f"/\n(\n  {total}\n  - on (node, device) {pool}\n  > 0)")
