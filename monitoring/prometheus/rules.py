"""embedfleet's recording rules and alerts, as data built from ``thresholds`` and ``queries``.

``generate.py`` writes them to ``rules/*.yml``; ``tests/*.yml`` pin their behaviour with
``promtool test rules``.

Every aggregation names the labels it keeps (``by (...)``): Ray adds per-process labels
(``WorkerId``, ``Component``, ``SessionName``, ``NodeAddress``, ``Version``, ``otel_scope_*``) and
Prometheus adds ``instance``; a replica restarted on the same card briefly has two series, so
per-card values are ``max``-ed rather than summed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import queries as q
from .. import thresholds as t
from ..queries import series

# Exported (scraped) names, spelled once here.
REQUESTS = "ray_embedfleet_requests_total"
LATENCY_BUCKET = "ray_embedfleet_request_latency_seconds_bucket"
INPUT_TOKENS = "ray_embedfleet_input_tokens_total"
OVERLOAD = "ray_embedfleet_overload_rejections_total"
PROMPT_TOKENS = "ray_embedfleet_prompt_tokens_total"
HIT_TOKENS = "ray_embedfleet_prefix_cache_hit_tokens_total"
AFFINITY_ROUTED = "ray_embedfleet_affinity_routed_total"
REPLICA_READY = "ray_embedfleet_replica_ready"
MEM_USED = "ray_embedfleet_card_memory_used_bytes"
MEM_TOTAL = "ray_embedfleet_card_memory_total_bytes"
INFLIGHT_TOKENS = "ray_embedfleet_inflight_tokens"
INFLIGHT_SEQS = "ray_embedfleet_inflight_sequences"
BUDGET_TOKENS = "ray_embedfleet_budget_tokens"
BUDGET_SEQS = "ray_embedfleet_budget_sequences"
CACHE_ENABLED = "ray_embedfleet_prefix_cache_enabled"
CANARY_COSINE = "ray_embedfleet_canary_last_cosine"
CANARY_FAILURES = "ray_embedfleet_canary_failures_total"
CANARY_VERDICT = "ray_embedfleet_canary_verdict"
ENGINE_SWAPS = "ray_embedfleet_engine_swaps_total"
GOVERNOR_STALE = "ray_embedfleet_governor_stale"

WINDOW = "5m"  # the "5m" in the recording-rule names
EMBEDDING_APIS = f'api=~"{"|".join(t.EMBEDDING_APIS)}"'

# Go-template fragments for annotations.
MODEL = "{{ $labels.model }}"
CARD = "{{ $labels.node }}/{{ $labels.device }}"
PCT = "{{ $value | humanizePercentage }}"


@dataclass(frozen=True)
class Recording:
    record: str
    expr: str


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str | None
    severity: str
    summary: str
    description: str


def _rate(metric: str, *matchers: str) -> str:
    return f"rate({series(metric, *matchers)}[{WINDOW}])"


def _ratio_or_zero(num: str, den: str, by: str) -> str:
    """``num / den`` per ``by``, 0 (not absent) when the numerator counter was never incremented.

    Ray exports a counter only after its first increment, so "no errors yet" is a missing
    series; ``or 0 * den`` turns that into 0 for every label set the denominator has. With no
    traffic at all the result is NaN, which compares false, so alerts stay quiet.
    """
    return (f"(\n  sum by ({by}) ({num})\nor\n  0 * sum by ({by}) ({den})\n)\n"
            f"/\nsum by ({by}) ({den})")


def _quantile(phi: float) -> str:
    return (f"histogram_quantile({phi},\n  sum by (model, le) "
            f"({_rate(LATENCY_BUCKET, EMBEDDING_APIS)})\n)")


def _fill(inflight: str, budget: str, kind: str) -> str:
    keep = "model, node, device"
    return (f'label_replace(\n    max by ({keep}) ({series(inflight)})\n'
            f'  / max by ({keep}) ({series(budget)} > 0),\n'
            f'  "budget", "{kind}", "", "")')


RECORDING_RULES: tuple[Recording, ...] = (
    Recording(q.REQUESTS_BY_CODE_RATE,
              f"sum by (model, api, status_code) ({_rate(REQUESTS)})"),
    Recording(q.REQUESTS_RATE, f"sum by (model) ({_rate(REQUESTS)})"),
    Recording(q.ERRORS_RATIO,
              _ratio_or_zero(_rate(REQUESTS, f'status_code=~"{t.ERROR_STATUS_REGEX}"'),
                             _rate(REQUESTS), "model")),
    Recording(q.LATENCY_P50, _quantile(0.5)),
    Recording(q.LATENCY_P99, _quantile(0.99)),
    Recording(q.INPUT_TOKENS_RATE, f"sum by (model) ({_rate(INPUT_TOKENS)})"),
    Recording(q.OVERLOAD_REJECTIONS_RATE, f"sum by (model, reason) ({_rate(OVERLOAD)})"),
    Recording(q.PREFIX_CACHE_HIT_RATIO,
              _ratio_or_zero(_rate(HIT_TOKENS), _rate(PROMPT_TOKENS), "model")),
    Recording(q.CARD_PREFIX_CACHE_HIT_RATIO,
              _ratio_or_zero(_rate(HIT_TOKENS), _rate(PROMPT_TOKENS), "model, node, device")),
    Recording(q.AFFINITY_ROUTED_RATE, f"sum by (model, outcome) ({_rate(AFFINITY_ROUTED)})"),
    # max per card first: a replica restarted on the same card is counted once.
    Recording(q.REPLICAS_READY,
              f"sum by (model) (max by (model, node, device) ({series(REPLICA_READY)}))"),
    # The governor queries this rule; `> 0` keeps a card that reports no capacity yet out
    # (no division by zero, no +Inf ratio that would read as "full").
    Recording(q.CARD_MEMORY_RATIO,
              q.live_ratio(q.per_card(q.ray_gauge(MEM_USED)),
                           q.per_card(q.ray_gauge(MEM_TOTAL)))),
    # The binding budget is whichever is fuller; the `budget` label keeps the two fills apart
    # until the max (without it `or` would drop the second).
    Recording(q.BUDGET_FILL_RATIO,
              f"max by (node, device) (\n  {_fill(INFLIGHT_TOKENS, BUDGET_TOKENS, 'tokens')}\n"
              f"or\n  {_fill(INFLIGHT_SEQS, BUDGET_SEQS, 'sequences')}\n)"),
)


def _counted_recently(counter: str, window: str, *matchers: str) -> str:
    """Per model: ``counter`` counted something in the last ``window``.

    That is either an increase of a counter we saw before, or a counter series that is new in
    the window (Ray exports a counter only from its first increment, which `increase` cannot
    see: it has no earlier sample)."""
    c = series(counter, *matchers)
    return (f"sum by (model) (increase({c}[{window}])) > 0\n"
            f"or\nsum by (model) ({c} unless {c} offset {window}) > 0")


_FAILED_RECENTLY = _counted_recently(CANARY_FAILURES, t.CANARY_FAILURE_WINDOW)
_SWAP_FAILED_RECENTLY = _counted_recently(ENGINE_SWAPS, t.ENGINE_SWAP_FAILURE_WINDOW,
                                          'outcome="failed"')
INCONCLUSIVE = 'verdict="inconclusive"'
GOVERNOR_HIGH = "ray_embedfleet_governor_high"
# The governor's own threshold per card (a card profile sets it per model); a card the governor
# does not report on is held to the configured default.
_MEMORY_AT_HIGH = (f"{q.CARD_MEMORY_RATIO}\n>= on (node, device) (\n"
                   f"  {q.per_card(q.ray_gauge(GOVERNOR_HIGH))}\n"
                   f"  or\n  0 * {q.CARD_MEMORY_RATIO} + {t.CARD_MEMORY_HIGH}\n)")

ALERTS: tuple[Alert, ...] = (
    Alert("EmbedfleetCardMemoryHigh", _MEMORY_AT_HIGH, t.CARD_MEMORY_HIGH_FOR,
          t.SEVERITY_CRITICAL,
          f"Card {CARD} memory pressure outside the KV pool at {PCT}.",
          f"Card {CARD} has been at or above the memory governor's cut threshold (its card "
          f"profile's, else {t.CARD_MEMORY_HIGH:.0%}) for {t.CARD_MEMORY_HIGH_FOR}: device used "
          "minus the KV pool and the allocator's releasable cache, over the card minus the KV "
          "pool (a full KV pool is not pressure, and raw used/total stays high from vLLM's "
          "up-front reservation). The governor cuts this card's batch budget at that level; "
          "staying there means the cuts are not bringing memory down and the engine is close "
          "to running out of memory."),
    Alert("EmbedfleetCanaryFailed", _FAILED_RECENTLY, None, t.SEVERITY_CRITICAL,
          f"Prefix-cache canary failed for {MODEL}.",
          f"A prefix-cache canary of {MODEL} produced cache-hit embeddings that differ from cold "
          f"ones (cosine below {t.CANARY_FAIL_COSINE}) in the last {t.CANARY_FAILURE_WINDOW}. "
          "Vectors served from the cache before the replicas restarted without it may be "
          "wrong."),
    Alert("EmbedfleetPrefixCacheDisabledByCanary",
          f"max by (model) ({series(CACHE_ENABLED)}) == 0\nand on (model)\n(\n"
          f"  min by (model) ({series(CANARY_COSINE)}) < {t.CANARY_FAIL_COSINE}\nor\n"
          f"  sum by (model) (max_over_time({series(CANARY_FAILURES)}"
          f"[{t.CANARY_FAILURE_WINDOW}])) > 0\n)",
          t.PREFIX_CACHE_DISABLED_FOR, t.SEVERITY_WARNING,
          f"Prefix caching of {MODEL} is off because its canary failed.",
          f"{MODEL} runs without prefix caching since a canary found cache-hit embeddings that "
          "differ from cold ones. Results are correct but repeated prefixes are recomputed, so "
          "throughput is lower than planned."),
    Alert("EmbedfleetCanaryInconclusive",
          f"max by (model) ({series(CANARY_VERDICT, INCONCLUSIVE)}) == 1",
          t.CANARY_INCONCLUSIVE_FOR, t.SEVERITY_WARNING,
          f"Prefix-cache canary of {MODEL} is inconclusive.",
          f"The last prefix-cache canary of {MODEL} has been inconclusive for "
          f"{t.CANARY_INCONCLUSIVE_FOR}: it observed no cache hit, or its cache-hit vectors "
          "differ from cold ones by more than the replica's calibrated floor yet less than a "
          f"failure (cosine {t.CANARY_FAIL_COSINE}), so nothing is proven, yet the model keeps "
          "serving from the prefix cache. The replica reruns the canary. Compare the last cosine "
          "with the floor on the dashboard; check whether the model's prefix cache hits at all "
          "(vLLM prefix-cache hit rate) and the canary's detail in the replica log (a full KV "
          "pool can evict the canary's prefix before its cache-hit pass)."),
    Alert("EmbedfleetEngineSwapFailing", _SWAP_FAILED_RECENTLY, None, t.SEVERITY_CRITICAL,
          f"Engine swap failing for {MODEL}.",
          f"A replica of {MODEL} failed to start its engine without prefix caching (after a "
          f"failed canary) in the last {t.ENGINE_SWAP_FAILURE_WINDOW}. That replica serves "
          "nothing while it retries, and Serve replaces it once it gives up. On a real card, "
          "check that the old engine released the card's memory: two engines do not fit."),
    Alert("EmbedfleetGovernorStale",
          f"max({series(GOVERNOR_STALE)}) > 0\nor\n("
          f"max(absent({series(GOVERNOR_STALE)}))\n  and on ()\n"
          f"sum({series(REPLICA_READY)}) > 0)",
          t.GOVERNOR_STALE_FOR, t.SEVERITY_WARNING,
          "The memory governor is not steering batch budgets.",
          f"For {t.GOVERNOR_STALE_FOR} the memory governor has held its last limits (Prometheus "
          f"unreachable, or {q.CARD_MEMORY_RATIO} missing or older than "
          f"{t.GOVERNOR_STALE_AFTER_S:g}s), or no governor is reporting while replicas run. "
          "Cards are unprotected if load grows."),
    Alert("EmbedfleetErrorRatioHigh",
          f"{q.ERRORS_RATIO} > {t.ERROR_RATIO_MAX}", t.ERROR_RATIO_FOR, t.SEVERITY_CRITICAL,
          f"{MODEL}: {PCT} of requests fail with a server error.",
          f"More than {t.ERROR_RATIO_MAX:.0%} of {MODEL}'s requests have answered 5xx over "
          f"{WINDOW} windows for {t.ERROR_RATIO_FOR}."),
    Alert("EmbedfleetNoReadyReplica",
          f"max by (model) (max_over_time({series(REPLICA_READY)}[{t.MODEL_SEEN_WINDOW}]))\n"
          f"unless on (model)\n({q.REPLICAS_READY} > 0)",
          t.NO_READY_REPLICA_FOR, t.SEVERITY_CRITICAL,
          f"{MODEL} has no ready replica.",
          f"No replica of {MODEL} has been ready for {t.NO_READY_REPLICA_FOR}; the router "
          "answers 503 to every request for it."),
    Alert("EmbedfleetLatencyP99High",
          f"{q.LATENCY_P99} > {t.LATENCY_P99_MAX_S:g}", t.LATENCY_P99_FOR, t.SEVERITY_WARNING,
          f"{MODEL}: p99 latency {{{{ $value | humanizeDuration }}}}.",
          f"The 99th percentile of {MODEL}'s embedding latency has been above "
          f"{t.LATENCY_P99_MAX_S:g}s for {t.LATENCY_P99_FOR}."),
)


def recording_groups() -> dict:
    """The recording-rule file as a YAML-ready dict (one group: rules evaluate in order)."""
    return {"groups": [{"name": "embedfleet.recording",
                        "rules": [{"record": r.record, "expr": r.expr} for r in RECORDING_RULES]}]}


def alert_groups() -> dict:
    """The alert file as a YAML-ready dict."""
    rules = []
    for a in ALERTS:
        rule: dict = {"alert": a.name, "expr": a.expr}
        if a.for_:
            rule["for"] = a.for_
        rule["labels"] = {"severity": a.severity}
        rule["annotations"] = {"summary": a.summary, "description": a.description,
                               "runbook_url": t.runbook_url(a.name)}
        rules.append(rule)
    return {"groups": [{"name": "embedfleet.alerts", "rules": rules}]}
