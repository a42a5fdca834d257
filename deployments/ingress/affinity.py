"""Prefix-affinity routing: Serve's request router for an engine deployment (``routing`` config).

Where it runs: in each Router replica, one instance per engine deployment handle, on Serve's
routing event loop (``deployments/config/ray_options.py`` names this class in ``request_router_config``).
Serve pickles the class by value, so it keeps no module-level state and imports only what a Router
replica already has; it never blocks (no ``ray.get``, no tokenizer) and never raises out of
``choose_replicas``: a raise there would leave the request unrouted.

What it does (see ``config.affinity.RoutingConfig``):
* the key of an ``embed`` call is its ``prompt_name``, ``task`` (together: the instruction
  template the replica renders) and the first input's head — what vLLM's prefix cache hashes
  first. It is placed on a consistent-hash ring of the replicas (``vnodes`` points each, stable
  hashes), so every Router replica prefers the same replica for a key with no shared state, and a
  replica joining or leaving moves only its own arcs;
* the preferred replica is tried first while it is under the bounded-load limit, then Serve's
  power-of-two choice (its locality preference included) as the next rank; over the limit, or
  without a key, power-of-two alone. Only replicas that report their prefix cache on
  (``record_routing_stats``) are preferred: a model whose cache is off is routed as by default;
* a replica swapping its engine (it holds its calls at its gate, for minutes on a card) is
  tried last, after every replica that serves;
* a replica a round found goes to that round's own call only when it is the call's preferred
  replica; any other goes to the oldest waiting call, as Serve's FIFO does, so under overload a
  call in a long backoff is not overtaken by younger ones.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import math
import weakref
from dataclasses import dataclass
from typing import Any

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from ..common import metrics
from ..common.contracts import RoutingStats
from ..config.ray_options import model_of_deployment

logger = logging.getLogger("ray.serve")

KEYED_METHODS = frozenset({"embed"})  # tokenize_tei runs no prefill: any replica will do
SEP = b"\x1f"
ROUNDS_PRUNE_AT = 1024


def stable_hash(data: bytes) -> int:
    """Equal in every process (Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def affinity_key(call: Any, prefix_chars: int, prefix_tokens: int) -> bytes | None:
    """The bytes that decide the preferred replica of an ``EmbedCall`` (None: no key)."""
    inputs = getattr(call, "inputs", None)
    if not inputs:
        return None
    first = inputs[0]
    head = (first[:prefix_chars].encode("utf-8", "replace") if isinstance(first, str)
            else b",".join(b"%d" % t for t in first[:prefix_tokens]))
    return SEP.join(((call.prompt_name or "").encode(), (call.task or "").encode(), head))


class HashRing:
    """Replicas on a ring of ``vnodes`` points each; a key belongs to the next point clockwise."""

    def __init__(self, vnodes: int) -> None:
        self.vnodes = vnodes
        self.members: frozenset[ReplicaID] = frozenset()
        self._points: list[int] = []
        self._owners: list[ReplicaID] = []

    def rebuild(self, members: frozenset[ReplicaID]) -> None:
        if members == self.members:
            return
        pts = sorted((stable_hash(f"{r.unique_id}#{i}".encode()), r)
                     for r in members for i in range(self.vnodes))
        self._points = [p for p, _ in pts]
        self._owners = [r for _, r in pts]
        self.members = members

    def owner(self, key: bytes, alive: Any) -> ReplicaID | None:
        """The first owner clockwise of ``key`` that is still in ``alive`` (a replica that died
        since the last rebuild is skipped, and its keys go where a rebuild would send them)."""
        n = len(self._points)
        start = bisect.bisect_right(self._points, stable_hash(key))
        for j in range(n):
            rid = self._owners[(start + j) % n]
            if rid in alive:
                return rid
        return None


def under_bound(load: int, loads: list[int], load_factor: float, min_bound: int) -> bool:
    """Consistent hashing with bounded loads: one more call keeps the replica within
    ``load_factor`` x the mean (the new call counted), or within ``min_bound`` calls: at low load
    the mean rounds to 1, and a replica that batches well should not lose its keys for a
    second call in flight."""
    limit = max(min_bound, math.ceil(load_factor * (sum(loads) + 1) / max(1, len(loads))))
    return load + 1 <= limit


@dataclass(frozen=True)
class KeyedRound:
    """A keyed call's routing round: the call (weakly: Serve owns it) and its preferred replica."""

    request: weakref.ref
    preferred: ReplicaID

    def pending(self) -> PendingRequest | None:
        pr = self.request()
        return pr if pr is not None and not pr.future.done() else None


class PrefixAffinityPolicy(PowerOfTwoChoicesRequestRouter):
    """Serve's request-router plug-in for calls to engine replicas (it runs in the caller's
    process): which replica takes a call. "Router" in embedfleet is only the ingress deployment."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ring = HashRing(64)
        self._caching: frozenset[ReplicaID] = frozenset()
        self._holding: frozenset[ReplicaID] = frozenset()  # swapping: calls wait at their gate
        # Each keyed request's routing round, by id(metadata) (see _fulfill_next_pending_request).
        self._rounds: dict[int, KeyedRound] = {}
        self._offered: ReplicaID | None = None  # the replica being handed out right now
        self._rec = metrics.Batched()
        self._flusher: asyncio.Task | None = None
        self._model = model_of_deployment(self._deployment_id.name)
        self.initialize_state()

    def initialize_state(self, load_factor: float = 1.5, min_bound: int = 4,
                         prefix_chars: int = 256, prefix_tokens: int = 64, vnodes: int = 64,
                         **_unknown: Any) -> None:
        self._load_factor, self._min_bound = float(load_factor), int(min_bound)
        self._prefix_chars, self._prefix_tokens = int(prefix_chars), int(prefix_tokens)
        if int(vnodes) != self._ring.vnodes:
            self._ring = HashRing(int(vnodes))

    # -- membership ------------------------------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        try:
            self._ring.rebuild(frozenset(self._replica_id_set))
            stats = {r.replica_id: _stats(r) for r in replicas}
            self._caching = frozenset(rid for rid, s in stats.items() if s.prefix_cache)
            self._holding = frozenset(rid for rid, s in stats.items() if not s.serving)
        except Exception:  # keep routing (power-of-two) whatever the stats say
            logger.exception("prefix-affinity router: replica update failed")

    # -- routing ---------------------------------------------------------------------------------
    def preferred(self, pending_request: PendingRequest | None) -> ReplicaID | None:
        if (pending_request is None or not pending_request.args
                or pending_request.metadata.call_method not in KEYED_METHODS):
            return None
        key = affinity_key(pending_request.args[0], self._prefix_chars, self._prefix_tokens)
        if key is None:
            return None
        rid = self._ring.owner(key, self._replicas)
        return rid if rid in self._caching else None

    def _load(self, rid: ReplicaID) -> int:
        return self.replica_queue_len_cache.get(rid) or 0  # None: no fresh entry -> idle

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        try:
            self._start_flusher()
            pow2 = await super().choose_replicas(candidate_replicas, pending_request)
            if pending_request is None:
                return self._holding_last(pow2, candidate_replicas)
            rid = self.preferred(pending_request)
            if rid is None:
                return self._holding_last(pow2, candidate_replicas)
            self._remember(pending_request, rid)
            loads = [self._load(r) for r in self._replica_id_set]
            if not under_bound(self._load(rid), loads, self._load_factor, self._min_bound):
                return self._holding_last(pow2, candidate_replicas)
            rest = [[r for r in rank if r.replica_id != rid] for rank in pow2]
            return self._holding_last([[self._replicas[rid]], *(rank for rank in rest if rank)],
                                      candidate_replicas)
        except Exception:  # never leave a request unrouted
            logger.exception("prefix-affinity router: choose_replicas failed; any replica")
            return [candidate_replicas]

    def _holding_last(self, ranks: list[list[RunningReplica]],
                      candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        """Replicas swapping their engine go last, after every serving candidate (power-of-two
        samples two, so with three or more replicas a sample of [swapping, busy] would otherwise
        leave a third one idle): a call sent there waits for the new engine, minutes on a card.
        """
        held = [r for r in candidates if r.replica_id in self._holding]
        if not held:
            return ranks
        out = [[r for r in rank if r.replica_id not in self._holding] for rank in ranks]
        out = [rank for rank in out if rank]
        ranked = {r.replica_id for rank in out for r in rank}
        others = [r for r in candidates if r.replica_id not in self._holding
                  and r.replica_id not in ranked]
        serving = [*out, others] if others else out
        return [*serving, held] if serving else ranks

    def _remember(self, pending_request: PendingRequest, rid: ReplicaID) -> None:
        if len(self._rounds) > ROUNDS_PRUNE_AT:  # cancelled calls never reach on_request_routed
            self._rounds = {k: r for k, r in self._rounds.items() if r.pending()}
        self._rounds[id(pending_request.metadata)] = KeyedRound(weakref.ref(pending_request), rid)

    def _fulfill_next_pending_request(self, replica: RunningReplica,
                                      request_metadata: Any = None) -> None:
        self._offered = replica.replica_id
        try:
            super()._fulfill_next_pending_request(replica, request_metadata)
        finally:
            self._offered = None

    def _get_pending_request_matching_metadata(self, request_metadata: Any = None
                                               ) -> PendingRequest | None:
        """Which waiting call gets the replica a round found. Its own call, when the round was
        keyed and found that call's preferred replica: Serve's FIFO would hand it to the oldest
        waiting call, whose key another replica caches. Otherwise Serve's FIFO, the oldest
        first, as the default router: a call in a long backoff is not overtaken by younger
        ones. (Matching on ``internal_request_id`` is wrong here: the slices of one HTTP
        request share it.)"""
        r = self._rounds.get(id(request_metadata)) if request_metadata is not None else None
        pr = r.pending() if r is not None else None
        if pr is not None and pr.metadata is request_metadata and r.preferred == self._offered:
            return pr
        return super()._get_pending_request_matching_metadata(request_metadata)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        try:
            r = self._rounds.pop(id(pending_request.metadata), None)
            if r is not None and r.request() is pending_request:
                outcome = "preferred" if r.preferred == replica_id else "spilled"
                self._rec.inc("embedfleet_affinity_routed_total", 1,
                              {"model": self._model, "outcome": outcome})
        except Exception:
            logger.exception("prefix-affinity router: on_request_routed failed")

    def _start_flusher(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._rec.flush_forever())


def _stats(replica: RunningReplica) -> RoutingStats:
    """What the replica said: its prefix cache on, its engine serving. No report yet, or one this
    version cannot read (e.g. mid-upgrade): no preference for that replica, and not held back."""
    stats = replica.routing_stats
    if not stats:
        return RoutingStats(prefix_cache=False)
    try:
        return RoutingStats.model_validate(stats)
    except ValueError:
        logger.warning("prefix-affinity router: unreadable routing stats %r", stats)
        return RoutingStats(prefix_cache=False)
