"""STAND-IN Ray metrics agent — FOR TESTS ONLY. NO RAY, NO ENGINE, NO CARD BEHIND IT.

Every value it serves was set by a test, through the Python API or over HTTP. It exists so that
the memory governor's pressure signal can be exercised through a real Prometheus and real
PromQL without starting Ray or an engine: it serves, under ``/metrics``, the per-card series an
embedfleet engine replica exports through Ray's metrics agent, as Prometheus scrapes them (the
scrape job must be ``ray``, as in the shipped config, since every query selects ``job="ray"``).
Never point a real Prometheus at it.

What it imitates from Ray's export of the replica's gauges (``embedfleet.deployments.common.metrics``): the names
with Ray's ``ray_`` prefix —

  ray_embedfleet_card_memory_used_bytes       device memory in use (driver view)
  ray_embedfleet_card_memory_total_bytes      device capacity (the runtime's)
  ray_embedfleet_kv_cache_pool_bytes          vLLM's KV pool, preallocated
  ray_embedfleet_kv_cache_free_bytes          free part of the KV pool (saturation, not pressure)
  ray_embedfleet_allocator_cache_free_bytes   allocator-cached bytes in whole free segments

— labelled ``node`` and ``device`` (the replica's tags) plus the labels Ray adds to every user
metric (``WorkerId``, ``NodeAddress``, ``Component``, ``SessionName``, ``Version``). Each term of
each card is set on its own, and may be left out or dropped, so a test can show what a query
does when a replica has not exported one of them. Where it differs from Ray: values are exactly
what was set, with no reporting delay; and it serves ``standin_ray_agent_info`` so a stand-in
can never be mistaken for the real thing.

HTTP API (JSON bodies; values in bytes):
  GET  /metrics                        Prometheus text format
  POST /set    {"node", "device", "used"?, "total"?, "kv_pool"?, "kv_free"?, "cache_free"?,
                "worker_id"?}
               sets the given terms; the others keep their value (unset: not exported)
  POST /drop   {"node", "device", "terms": [...]}   stops exporting these terms of one card
  POST /remove {"node"?, "device"?}    drops whole cards (all, with an empty body)
  GET  /cards                          the current values as JSON
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from embedfleet.deployments.common.metrics import BY_NAME
from tests.support.standin_exporter import StandinExporter, info_lines, label

#: card term -> the series Prometheus scrapes (Ray's exported name of the replica's gauge).
SERIES: dict[str, str] = {
    "used": BY_NAME["embedfleet_card_memory_used_bytes"].exported[0],
    "total": BY_NAME["embedfleet_card_memory_total_bytes"].exported[0],
    "kv_pool": BY_NAME["embedfleet_kv_cache_pool_bytes"].exported[0],
    "kv_free": BY_NAME["embedfleet_kv_cache_free_bytes"].exported[0],
    "cache_free": BY_NAME["embedfleet_allocator_cache_free_bytes"].exported[0],
}
TERMS: tuple[str, ...] = tuple(SERIES)
INFO = "standin_ray_agent_info"

_ABOUT = __doc__ or ""  # served at GET /
_BANNER = "STAND-IN for tests, not a Ray metrics agent, not real card data"


@dataclass(frozen=True)
class Card:
    node: str
    device: str
    worker_id: str
    used: float | None = None
    total: float | None = None
    kv_pool: float | None = None
    kv_free: float | None = None
    cache_free: float | None = None


def render(cards: list[Card]) -> str:
    """The exposition text for these cards (Prometheus text format 0.0.4)."""
    lines = info_lines(INFO, _BANNER, "embedfleet's stand-in Ray metrics agent")
    for term, name in SERIES.items():
        lines += [f"# HELP {name} {_BANNER}: the replica's {term} term (bytes), set by a test.",
                  f"# TYPE {name} gauge"]
        for c in cards:
            value = getattr(c, term)
            if value is None:
                continue
            # A node name is the node IP unless Ray was started with --node-name; Ray's own
            # NodeAddress is always the IP, which the stand-in takes to be the node name.
            labels = ",".join(f'{k}="{label(v)}"' for k, v in (
                ("Component", "core_worker"), ("NodeAddress", c.node),
                ("SessionName", "session_standin"), ("Version", "standin"),
                ("WorkerId", c.worker_id), ("device", c.device), ("node", c.node)))
            lines.append(f"{name}{{{labels}}} {value!r}")
    return "\n".join(lines) + "\n"


class StandinRayAgent(StandinExporter[Card]):
    """The STAND-IN Ray metrics agent (``StandinExporter``: its card store and HTTP server)."""

    thread_name = "standin-ray-agent"
    about = _ABOUT

    def render(self, cards: list[Card]) -> str:
        return render(cards)

    def set_card(self, node: str, device: str | int, *, used: float | None = None,
                 total: float | None = None, kv_pool: float | None = None,
                 kv_free: float | None = None, cache_free: float | None = None,
                 worker_id: str | None = None) -> Card:
        """Set the given terms (bytes) of one card; terms not given keep their value, and a term
        never set is not exported. ``worker_id`` defaults to one per card."""
        terms = {"used": used, "total": total, "kv_pool": kv_pool, "kv_free": kv_free,
                 "cache_free": cache_free}
        for term, value in terms.items():
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{term} must be a finite number >= 0, got {value!r}")
        key = (str(node), str(device))
        with self._lock:
            card = self._cards.get(key) or Card(*key, worker_id=f"standin-{key[0]}-{key[1]}")
            card = replace(card, **{t: float(v) for t, v in terms.items() if v is not None},
                           **({"worker_id": str(worker_id)} if worker_id is not None else {}))
            self._cards[key] = card
        return card

    def drop(self, node: str, device: str | int, *terms: str) -> Card:
        """Stop exporting these terms of one card (as if the replica had not reported them)."""
        unknown = set(terms) - set(TERMS)
        if unknown or not terms:
            raise ValueError(f"terms must be some of {TERMS}, got {terms!r}")
        key = (str(node), str(device))
        with self._lock:
            if key not in self._cards:
                raise KeyError(f"no card {key[0]}/{key[1]}")
            card = self._cards[key] = replace(self._cards[key], **dict.fromkeys(terms))
        return card

    def post(self, path: str, body: dict[str, Any]) -> Any:
        if path == "/set":
            return asdict(self.set_card(body["node"], body["device"],
                                        worker_id=body.get("worker_id"),
                                        **{t: body.get(t) for t in TERMS}))
        if path == "/drop":
            return asdict(self.drop(body["node"], body["device"], *body["terms"]))
        return super().post(path, body)
