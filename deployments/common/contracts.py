"""Everything that crosses a process boundary, as typed models — in one place.

Router → replica (an embed call and its result), governor → replica (a card's limits), replica
→ registry → router and CLI (what a replica is and how it is doing), registry → replica (what
the fleet wants of it), and the fleet status that `/v1/models`, `/ready` and `embedfleet status`
all print. Readers use fields; nothing here is a dict read with ``.get``.

The request-path models are frozen dataclasses with slots: they are pickled by Ray for every
call, and a dataclass pickles in a fraction of a pydantic model's time. The control-plane models
are pydantic (validated once, dumped to JSON for status and ``/v1/models``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, PositiveInt
from typing_extensions import TypedDict  # pydantic documents only this TypedDict before 3.12

from .long_input import ChunkAbove, LongInputMode, LongInputPolicy

Lane = Literal["interactive", "bulk"]
LANES: tuple[Lane, ...] = get_args(Lane)  # in serving order: interactive first


# -- the request path (router -> replica -> router) ------------------------------------------------

@dataclass(frozen=True, slots=True)
class EmbedCall:
    """One router -> replica call: the inputs of one request, or one slice of a large one."""

    inputs: list[str] | list[list[int]]
    request_id: str
    model: str
    dimensions: int | None = None
    long_input: LongInputPolicy | None = None  # None: the model's configured policy
    prompt_name: str | None = None
    task: str | None = None
    normalize: bool = True
    lane: Lane = "interactive"


@dataclass(frozen=True, slots=True)
class InputReport:
    """What the long-input policy did to one input (only reported when it did something)."""

    index: int
    truncated: bool
    dropped_tokens: int
    chunks: int
    input_tokens: int


@dataclass(frozen=True, slots=True)
class EmbedResult:
    """The vectors of one call (rows of one float32 array, in input order) and its accounting."""

    vectors: np.ndarray
    prompt_tokens: int
    cached_tokens: int
    replica_id: str
    fingerprint: Fingerprint
    inputs: tuple[InputReport, ...] = ()


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What a vector store needs to tell comparable vectors apart (sent as x-embedfleet-*)."""

    model_digest: str
    dtype: str
    engine: str
    platform: str
    prefix_cache: bool

    def headers(self) -> dict[str, str]:
        return {"x-embedfleet-model-digest": self.model_digest, "x-embedfleet-dtype": self.dtype,
                "x-embedfleet-engine": self.engine, "x-embedfleet-platform": self.platform,
                "x-embedfleet-prefix-cache": "on" if self.prefix_cache else "off"}


def merged_headers(prints: list[Fingerprint]) -> dict[str, str]:
    """One set of headers for a response whose slices ran on several replicas; a field on which
    they differ reads "mixed" (e.g. one replica had already switched prefix caching off)."""
    first = prints[0].headers()
    for p in prints[1:]:
        for k, v in p.headers().items():
            if first[k] != v:
                first[k] = "mixed"
    return first


@dataclass(frozen=True, slots=True)
class BatchCall:
    """A batch of texts sent through the Router's Serve handle (``Router.embed_batch``): the
    corpus job's call. It runs the online pipeline (the same chunking, long-input policy and
    prompts), on the lane it names."""

    model: str
    texts: list[str]
    prompt_name: str | None = None
    lane: Lane = "bulk"
    long_input: LongInputMode | None = None  # None: the model's configured policy
    chunk_above: ChunkAbove | None = None  # None: the model's; a 400 unless the mode is chunk


@dataclass(frozen=True, slots=True)
class BatchResult:
    vectors: np.ndarray  # (texts, dimensions) float32, in input order
    tokens: tuple[int, ...]  # each text's own length in tokens (prompt included, before any cut)
    fingerprint: dict[str, str]  # the x-embedfleet-* fingerprint headers ("mixed" where split)


# -- control plane ---------------------------------------------------------------------------------

class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Ceiling(_Model):
    """A card's configured budget: the most the governor will ever allow it."""

    max_sequences: PositiveInt
    max_tokens: PositiveInt


class Limits(_Model):
    """What the governor hands a card: the budget now, and why."""

    max_sequences: PositiveInt
    max_tokens: PositiveInt
    stale: bool = False
    reason: str = ""
    ratio: float | None = None
    action: str = "start"


class BudgetView(_Model):
    """A replica's admission queue: its limits, what is in flight and waiting, its counters."""

    max_sequences: int
    max_tokens: int
    inflight_sequences: int
    inflight_tokens: int
    waiting: int
    waiting_sequences: int
    waiting_tokens: int
    max_waiting: int
    queue_timeout_s: float
    mean_hold_s: float | None
    admitted_total: int
    admitted_bulk_total: int = 0
    inflight_bulk_sequences: int = 0
    inflight_bulk_tokens: int = 0
    bulk_max_inflight_tokens: int = 0  # bulk's cap now: its share, or what drains in the bound
    drain_tokens_per_s: float | None = None  # the card's measured rate (replica/drain_rate)
    drain_capacity_tokens_per_s: float | None = None  # the rate bulk's cap is sized from
    waiting_bulk: int = 0
    oversize_total: int
    cancelled_total: int
    rejected: dict[str, int]
    stale: bool = False
    reason: str = ""


class MemoryView(_Model):
    """The replica's own reading of its card (the governor reads the same terms from Prometheus)."""

    ratio: float
    idle_ratio: float | None
    live_bytes: int
    used_bytes: int
    total_bytes: int
    kv_pool_bytes: int
    kv_peak_usage: float


class CanaryView(_Model):
    verdict: Literal["passed", "failed", "inconclusive"]
    passed: bool
    conclusive: bool
    min_cosine: float
    cached_tokens: int
    prefix_tokens: int
    probes: int
    at: float
    detail: str
    floor: float | None = None  # the cosine it had to reach (None: recorded before floors)


class SwapView(_Model):
    attempts: int = 0
    error: str | None = None
    gave_up: bool = False


class PrefixCacheView(_Model):
    enabled: bool | None
    state: str
    reason: str
    last_canary: CanaryView | None = None
    swap: SwapView = SwapView()


class ReplicaDescription(_Model):
    """What one replica says about itself, every heartbeat."""

    replica_id: str
    model: str
    node_id: str
    node: str
    node_ip: str
    device: str
    pid: int
    ready: bool
    # False while an engine swap holds the replica's calls at its gate (minutes on a card): the
    # routers hold calls for it as for a replica starting, instead of cutting them.
    serving: bool = True
    # Engines this replica restarted in place after one died (replica/engine_restart.py).
    engine_restarts: int = 0
    max_model_len: int
    dimensions: int
    matryoshka_dimensions: list[int]
    dtype: str
    block_size: int
    engine_version: str
    platform: str
    prefix_cache: PrefixCacheView
    fingerprint: dict[str, str]
    budget: BudgetView
    memory: MemoryView | None = None
    seen_at: float = 0.0


class RoutingStats(_Model):
    """What a replica tells Serve's request router every few seconds (``record_routing_stats``;
    Serve carries it as a dict): whether a call's prefix can hit its cache now, and whether its
    engine takes calls now (False while a swap holds them at its gate)."""

    prefix_cache: bool
    serving: bool = True


class Override(_Model):
    """Prefix caching switched off for a model by a failed canary (kept until cleared)."""

    reason: str
    canary: CanaryView | None = None
    at: float


class HeartbeatReply(_Model):
    prefix_cache_override: Override | None = None


# -- the fleet's status (one assembly: /v1/models, /ready, `embedfleet status`) ---------------------

class CardStatus(_Model):
    node: str
    device: str
    replica_id: str
    ready: bool
    pid: int
    budget: BudgetView
    memory: MemoryView | None
    block_size: int
    prefix_cache: PrefixCacheView
    engine_restarts: int = 0


class ModelStatus(_Model):
    model: str
    min_replicas: int
    max_replicas: int
    ready: int
    state: Literal["serving", "scaled to zero", "starting", "waiting for a card"]
    waiting: str = ""
    """Why replicas wait for a card (empty when none does)."""
    max_input_tokens: int | None
    dimensions: int | None
    matryoshka_dimensions: list[int] = []
    prefix_cache: PrefixCacheView
    cards: list[CardStatus]


class ModelReadiness(_Model):
    """Whether a model can serve now, for the router's fail-fast (registry -> router, ~1 s old).

    ``starting``: replica actors that exist (or are being created on a node with a free card)
    but are not serving yet — an engine loading or swapping, or a replacement on its way.
    ``waiting``: why replicas wait for a card no node has free ("" if none wait).
    ``never``: why the model can never get a card ("" unless every card is held for good)."""

    ready: int
    starting: int
    waiting: str = ""
    never: str = ""
    checked_at: float


class FleetStatus(_Model):
    app: str
    models: list[ModelStatus]

    @property
    def missing(self) -> list[str]:
        """Models that must stay up (min_replicas >= 1) with no ready replica."""
        return [m.model for m in self.models if m.ready == 0 and m.min_replicas > 0]


class SimpleToken(TypedDict):
    """One token of TEI's ``/tokenize`` answer (the replica builds them, the Router sends them)."""

    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None
