"""Every threshold, duration and selector of embedfleet's monitoring, with why it has its value.

Rules, alerts, the dashboard and the promtool tests are built from these names; the memory
governor's defaults (``embedfleet.deployments.fleet.governor_law.GovernorParams``) must agree with the card-memory
band here, and a test checks that they do. Durations are Prometheus duration strings because they
go straight into rule YAML.
"""

from __future__ import annotations

# --- Selectors --------------------------------------------------------------------------------
# Ray's service-discovery file labels every metrics-agent target ``job="ray"`` (and a file_sd
# target label wins over ``job_name``), so every embedfleet series carries it. Selecting on it
# keeps rules from double counting if the same agents are also scraped by another job (e.g. a
# KubeRay PodMonitor); deployments that scrape Ray under another job name change it here only.
RAY_JOB = "ray"
SELECTOR = f'job="{RAY_JOB}"'

# Latency is judged on the APIs that embed. ``models`` and ``tokenize`` answer in microseconds and
# would drag the quantiles down, hiding slow embeddings. ``batch`` (the corpus job's Serve-handle
# calls, hundreds of texts on the bulk lane) is throughput work: its seconds are not a user's wait.
EMBEDDING_APIS: tuple[str, ...] = ("embeddings", "embed")

# Server-side failures. 4xx are the client's mistakes and 429 is admission control doing its job
# (it has its own panel); neither means the service is broken.
ERROR_STATUS_REGEX = "5.."

# --- Scrape and evaluation --------------------------------------------------------------------
# Ray's metrics agent refreshes user metrics about every 10 s (metrics_report_interval_ms); a 5 s
# scrape never adds more than half of that to the age of a reading, and evaluating rules at the
# same pace keeps card:embedfleet_memory:ratio at most ~20 s behind the card. Cheap: one local
# target per node.
SCRAPE_INTERVAL = "5s"
EVALUATION_INTERVAL = "5s"

# Ray-exported gauges are read through last_over_time(...[RAY_GAUGE_LOOKBACK]): Ray's metrics agent
# reports every ~10 s, and between reports a gauge can miss a scrape (Ray 2.55, what the Ascend
# stack runs, clears gauges after each read; 2.60 under load was seen to miss some too). A missed
# scrape would make the card vanish from the governor's query for that tick. 30 s covers two
# reports plus a scrape; a replica that died drops out after it.
RAY_GAUGE_LOOKBACK = "30s"

# --- Card memory (shared with the governor) ---------------------------------------------------
# The ratio is pressure outside the KV pool (``queries.live_ratio``): device used minus the KV
# pool and the allocator's releasable cache, over the card minus the KV pool. Raw used/total
# cannot be the signal: vLLM reserves gpu_memory_utilization (0.95 on the 910B profile) at
# start-up, so it reads ~0.95 at idle and would sit above HIGH for good; nor can the pool's fill,
# which allocates nothing.
# At or above HIGH the governor cuts a card's batch budget; at or below LOW it grows it back; in
# between it holds. These are the band of a card without a card profile: with one, the profile
# sets it per model (cut where only its safety margin is left, grow at its planned operating
# point; ``governor_law.params_for_profile``), because where a card sits at its plan depends on
# the card, engine and model. The 10-point dead band is wider than the few percent one large
# batch moves memory, so the governor does not oscillate.
CARD_MEMORY_HIGH = 0.90
CARD_MEMORY_LOW = 0.80
# One minute is two governor cooldowns (30 s): by then at least two cuts should have landed. A
# card still at HIGH has a governor that is not winning, and an engine OOM kills every request in
# flight on the card and takes minutes to reload an 8B model.
CARD_MEMORY_HIGH_FOR = "1m"

# --- Governor ---------------------------------------------------------------------------------
# The governor ignores a memory reading older than this: several scrape/report cycles (so one
# missed scrape does not flap the stale flag), far below Prometheus' 5-minute lookback.
GOVERNOR_STALE_AFTER_S = 60.0
# Holding the last limits is safe for a while (budgets only matter when load changes); a couple
# of minutes separates a Prometheus restart or a blip from a governor that is really blind.
GOVERNOR_STALE_FOR = "2m"

# --- Prefix cache and canary ------------------------------------------------------------------
# The canary compares a cache-hit vector with the cold vector of the same input. Below this
# cosine it fails: the cache changed the result (vllm-ascend's own prefix-cache test accepts
# 1e-2; the corruption it guards against reads ~0.58). Between it and the replica's calibrated
# floor (embedfleet_canary_floor) the verdict is inconclusive, not a failure. Equal to
# deployments/replica/canary.py's FAIL_COSINE (a test checks).
CANARY_FAIL_COSINE = 0.99
# A failed canary means wrong vectors may have been served: alert at once. The failure counter
# lives in replicas that restart right after it (with caching off), so the rule looks back this
# far for any failure; 15 m is long enough for a person to see the alert, short enough to clear.
CANARY_FAILURE_WINDOW = "15m"
# "Cache disabled by the canary" is a state (slower, not wrong). It waits out the restart the
# canary itself triggers, during which old and new replicas disagree about the cache.
PREFIX_CACHE_DISABLED_FOR = "5m"
# An inconclusive canary saw no cache hit, so it proved nothing, while the model keeps serving
# from the prefix cache. The replica reruns it at once a few times at start-up, then every
# quarter of ``canary_interval_s`` (75 s with the 300 s default) while inconclusive. A cold
# start or a busy pool evicting the probe's blocks once clears within a rerun or two; after
# 15 m (~12 reruns without a hit) the cache is not hitting, or the canary cannot make it hit,
# and nobody has proven the cached vectors. Warning, not critical: unproven is not wrong.
CANARY_INCONCLUSIVE_FOR = "15m"
# A failed engine swap (the engine without prefix caching did not start after a failed canary)
# leaves the replica with no engine: its calls wait and then fail over while it retries a few
# times with backoff (about 2 minutes of waits in all), after which Serve replaces it. The
# model serves on one card fewer, so any failure pages; on a real card the likely cause is the
# old engine's memory not yet free (vLLM will not start without gpu_memory_utilization of the
# card free).
# The counter lives in a replica Serve may replace, so, as for canary failures, the rule looks
# back this far: long enough for a person to see the alert, short enough to clear.
ENGINE_SWAP_FAILURE_WINDOW = "15m"

# --- Errors and latency -----------------------------------------------------------------------
# Embedding calls are idempotent and clients retry; past 5% server errors for 5 minutes the
# retries no longer hide the failures from users.
ERROR_RATIO_MAX = 0.05
ERROR_RATIO_FOR = "5m"
# p99 of the router's latency on the embedding APIs. A full batch of long inputs takes ~1 s on a
# 910B; twice that, sustained, is degradation (queueing or a slow card), not one bulky request.
# The histogram's buckets around it are 1.024 s and 2.048 s, so the quantile is interpolated.
LATENCY_P99_MAX_S = 2.0
# Autoscaling and model loads cause minutes-long spikes that fix themselves; 10 m does not page
# for those.
LATENCY_P99_FOR = "10m"

# --- Replicas ---------------------------------------------------------------------------------
# A model with no ready replica answers 503 to everything. 2 m covers a replica restart of a
# small model without paging, and is short for a user-visible outage.
NO_READY_REPLICA_FOR = "2m"
# Replica series vanish with their worker, so "this model exists" is "some replica of it
# reported in the last hour". A model removed from the config on purpose alerts for at most this
# long; a shorter window would forget a model whose replicas have been crash-looping for a while.
MODEL_SEEN_WINDOW = "1h"

# --- Alert routing ----------------------------------------------------------------------------
# critical: users get errors or wrong vectors now, or will within minutes (page).
# warning:  degraded or unprotected; look during working hours (ticket).
SEVERITY_CRITICAL = "critical"
SEVERITY_WARNING = "warning"

# Runbook sections live next to the rules (monitoring/runbook.md); each alert links to the
# section named after it (GitHub anchors are the lower-cased heading).
RUNBOOK_BASE_URL = "https://github.com/embedfleet/embedfleet/blob/main/monitoring/runbook.md"


def runbook_url(alertname: str) -> str:
    """Link to the runbook section for ``alertname``."""
    return f"{RUNBOOK_BASE_URL}#{alertname.lower()}"
