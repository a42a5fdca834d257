"""PromQL for "card memory ratio per (node, device)", and a small client that runs it.

Why presets: the governor reads card memory through one PromQL query for all cards, and where
the device's used and total come from depends on the site — embedfleet's own replica metrics
(every platform), Huawei's npu-exporter on Ascend nodes, or NVIDIA's DCGM exporter. Every preset
returns the same shape, one series per card labelled ``node`` and ``device`` whose value is the
pressure outside the KV pool (``embedfleet.monitoring.queries.live_ratio``): device used minus the
engine's KV pool and the allocator's releasable cache, over the card minus the KV pool. The two
engine terms always come from the replicas (vLLM's pool size and the worker's allocator), so a
raw exporter reading, saturated by vLLM's reservation, never reaches the governor.

Scales. The card's total is the runtime's (``mem_get_info``, exported by the replica), because
that is what vLLM plans with; exporters count differently: npu-smi reports a 64 GB 910B as 65,536
MB with ~3 GB "used" at idle, memory the runtime never hands out (it reports ~60.96 GiB: vllm-ascend
#4404); DCGM's used + free leaves out what the driver reserves. The exporter presets therefore put
the exporter's used on the runtime's scale by the difference of the two totals (exporter total −
runtime total: the part one counts and the other does not), every evaluation, which is the idle
offset without needing an idle moment. On Ascend the default stays the ``embedfleet`` preset: the
replica's own runtime reading, in the engine's own terms.

Each preset is two queries: ``ratio``, and ``sample_time`` — the timestamp of the sample the ratio
came from. An instant query stamps every result with the *evaluation* time, which would hide a
stuck exporter (npu-exporter sends its own timestamps, so its series do not go stale in Prometheus
for 5 minutes); ``timestamp()`` of the raw series tells the governor how old the reading really is.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import httpx

from ...monitoring.queries import CARD_MEMORY_RATIO, live_ratio, per_card, ray_gauge

#: The card's total as the engine's runtime reports it (``mem_get_info``), exported by replicas.
RUNTIME_TOTAL = "ray_embedfleet_card_memory_total_bytes"

# --- the presets ------------------------------------------------------------------------------

#: embedfleet's own card memory ratio is the recording rule that monitoring/ defines and the
#: card-memory alert fires on: one PromQL definition of "card memory ratio" (design, point 7).
EMBEDFLEET_RATIO_RECORD = CARD_MEMORY_RATIO

PresetName = Literal["embedfleet", "npu-exporter", "dcgm"]
PRESET_NAMES: tuple[PresetName, ...] = get_args(PresetName)


@dataclass(frozen=True)
class CardMemoryQuery:
    """A pair of PromQL instant queries, each giving one series per card labelled node, device."""

    name: str
    ratio: str
    """Value: used / total card memory."""
    sample_time: str | None
    """Value: unix seconds of the underlying sample. None: use the evaluation time."""


def _with_card_labels(expr: str, node_label: str, device_label: str,
                      aliases: dict[str, str] | None = None) -> str:
    """Copy the exporter's own node and device labels to ``node`` and ``device``; then rename
    nodes by ``aliases`` (exporter name → the node name replicas report), inside the query,
    because the replicas' KV terms are joined on ``node`` there."""
    out = expr
    if device_label != "device":
        out = f'label_replace({out}, "device", "$1", "{device_label}", "(.*)")'
    if node_label == "instance":
        # ``instance`` is host:port of the scrape target; the card's node is the host part
        # (IPv6 targets keep their brackets). label_replace regexes are fully anchored.
        out = f'label_replace({out}, "node", "$1", "instance", "(.*?)(?::[0-9]+)?")'
    elif node_label != "node":
        out = f'label_replace({out}, "node", "$1", "{node_label}", "(.*)")'
    for name, node in sorted((aliases or {}).items()):
        # A PromQL string literal: the regex's backslashes are escaped once more.
        pattern = re.escape(name).replace("\\", "\\\\")
        out = f'label_replace({out}, "node", "{node}", "node", "{pattern}")'
    return out


def exporter_query(name: str, used: str, total: str, *, unit_bytes: int, node_label: str,
                   device_label: str, aliases: dict[str, str] | None = None) -> CardMemoryQuery:
    """A preset over an exporter's used and total gauges (same unit, same label sets), put on
    the runtime's scale (module docstring): used − (exporter total − runtime total), over the
    runtime's total.

    Several series per card (two Prometheus jobs scraping one exporter, pod labels): the highest
    reading and the oldest sample are the cautious ones."""
    def as_bytes(expr: str) -> str:
        return per_card(_with_card_labels(f"{expr} * {unit_bytes}", node_label, device_label,
                                          aliases))

    runtime_total = per_card(ray_gauge(RUNTIME_TOTAL))
    on_runtime_scale = (f"{as_bytes(used)}\n  - on (node, device) ({as_bytes(total)} "
                        f"- on (node, device) {runtime_total})")
    when = _with_card_labels(f"timestamp({used})", node_label, device_label, aliases)
    return CardMemoryQuery(name=name, ratio=live_ratio(on_runtime_scale, runtime_total),
                           sample_time=f"min by (node, device) ({when})")


def npu_exporter_query(node_label: str = "node", device_label: str = "id",
                       aliases: dict[str, str] | None = None) -> CardMemoryQuery:
    """Huawei npu-exporter (Ascend): HBM used and total (MB), with the replicas' engine terms.

    npu-exporter labels chips with ``id`` (the host's chip id; replicas report the same, see
    ``embedfleet.deployments.engine.platform.host_chip_ids``) and has no node label: the
    scrape config must attach one (``node`` by default, e.g. a static target label or a relabel
    from ``__meta_kubernetes_pod_node_name``), or pass ``node_label="instance"`` to use the
    scrape target's host.
    """
    # npu-exporter's HBM gauges are in MB as npu-smi reports them (MiB).
    return exporter_query("npu-exporter", "npu_chip_info_hbm_used_memory",
                          "npu_chip_info_hbm_total_memory", unit_bytes=1 << 20,
                          node_label=node_label, device_label=device_label, aliases=aliases)


def dcgm_query(node_label: str = "Hostname", device_label: str = "gpu",
               aliases: dict[str, str] | None = None) -> CardMemoryQuery:
    """NVIDIA DCGM exporter: framebuffer used / (used + free), MiB."""
    return exporter_query("dcgm", "DCGM_FI_DEV_FB_USED",
                          "(DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE)", unit_bytes=1 << 20,
                          node_label=node_label, device_label=device_label, aliases=aliases)


PRESETS: dict[PresetName, CardMemoryQuery] = {
    "embedfleet": CardMemoryQuery("embedfleet", ratio=EMBEDFLEET_RATIO_RECORD,
                                  sample_time=f"timestamp({EMBEDFLEET_RATIO_RECORD})"),
    "npu-exporter": npu_exporter_query(),
    "dcgm": dcgm_query(),
}


# --- the client -------------------------------------------------------------------------------

CardKey = tuple[str, str]
"""(node, device)"""


class CardReading(NamedTuple):
    ratio: float
    """used / total; may be NaN if the exporter reports NaN."""
    sample_ts: float
    """unix seconds of the sample (the evaluation time when the query gives none)."""


class PrometheusUnavailable(RuntimeError):
    """Prometheus gave no usable answer (unreachable, timeout, non-200, not JSON).

    The governor's answer to this is always the same: hold every card's last limits, marked stale.
    """


class PrometheusQueryError(PrometheusUnavailable):
    """Prometheus answered but rejected the query or returned the wrong shape: a config bug, not
    an outage, but the governor still holds the last limits rather than guess."""


def _params(expr: str, timeout: float, at: float | None) -> dict[str, str]:
    # Prometheus' own ``timeout`` makes it abandon an evaluation we have stopped waiting for.
    # (Prometheus durations take no decimals: "2500ms", not "2.5s".)
    params = {"query": expr, "timeout": f"{max(1, round(timeout * 1000))}ms"}
    if at is not None:
        params["time"] = f"{at:.3f}"
    return params


def _parse_vector(resp: httpx.Response, expr: str) -> list[tuple[CardKey, float, float]]:
    """(card, eval_ts, value) per result series of an instant-vector answer."""
    where = f"Prometheus at {resp.request.url.copy_with(query=None)}"
    try:
        body = resp.json()
    except ValueError as exc:
        raise PrometheusUnavailable(f"{where} answered HTTP {resp.status_code} that is not JSON: "
                                    f"{resp.text[:200]!r}") from exc
    if resp.status_code in (400, 422) and isinstance(body, dict):
        # bad_data (400) / execution (422): Prometheus is up, the query is wrong.
        raise PrometheusQueryError(f"{where} rejected {expr!r}: {body.get('errorType')}: "
                                   f"{body.get('error')}")
    if resp.status_code != 200:
        raise PrometheusUnavailable(f"{where} answered HTTP {resp.status_code}: "
                                    f"{resp.text[:200]!r}")
    if not isinstance(body, dict) or body.get("status") != "success":
        raise PrometheusQueryError(f"{where} failed {expr!r}: {str(body)[:200]}")
    data = body.get("data") or {}
    if data.get("resultType") != "vector":
        raise PrometheusQueryError(f"{where}: {expr!r} gave {data.get('resultType')!r}, "
                                   "expected an instant vector")
    out = []
    for series in data.get("result") or ():
        try:
            labels, (ts, value) = series.get("metric", {}), series["value"]
            ts, value = float(ts), float(value)  # "NaN" and "+Inf" parse as floats
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise PrometheusQueryError(f"{where}: malformed series {str(series)[:200]}") from exc
        if "node" not in labels or "device" not in labels:
            raise PrometheusQueryError(f"{where}: {expr!r} gave a series without node/device "
                                       f"labels: {labels}")
        out.append(((labels["node"], labels["device"]), ts, value))
    return out


def _combine(ratios: list[tuple[CardKey, float, float]],
             times: list[tuple[CardKey, float, float]] | None) -> dict[CardKey, CardReading]:
    sample_ts: dict[CardKey, float] = {}
    for key, _, ts in times or ():
        sample_ts[key] = min(ts, sample_ts.get(key, math.inf))
    out: dict[CardKey, CardReading] = {}
    for key, eval_ts, ratio in ratios:
        # Duplicates only come from hand-written queries (presets aggregate): keep the highest,
        # and never let a NaN hide a real reading.
        if key in out and not (ratio > out[key].ratio or math.isnan(out[key].ratio)):
            continue
        # A card absent from the time query (it appeared between the two queries) was just
        # evaluated, so the evaluation time is an honest upper bound on its age.
        out[key] = CardReading(ratio, sample_ts.get(key, eval_ts))
    return out


def _as_query(query: CardMemoryQuery | str) -> CardMemoryQuery:
    return query if isinstance(query, CardMemoryQuery) else CardMemoryQuery("custom", query, None)


def query_card_ratios(prom_url: str, query: CardMemoryQuery | str, timeout: float = 5.0, *,
                      at: float | None = None,
                      client: httpx.Client | None = None) -> dict[CardKey, CardReading]:
    """Card memory ratios from Prometheus' HTTP API: {(node, device): (ratio, sample_ts)}.

    ``query`` is a preset (see ``PRESETS``) or a PromQL string giving series labelled node and
    device. Raises ``PrometheusUnavailable`` when Prometheus cannot answer.
    """
    q = _as_query(query)
    url = prom_url.rstrip("/") + "/api/v1/query"
    own = client is None
    c = client or httpx.Client(timeout=timeout)
    try:
        def run(expr: str) -> list[tuple[CardKey, float, float]]:
            try:
                resp = c.get(url, params=_params(expr, timeout, at), timeout=timeout)
            except httpx.HTTPError as exc:
                raise PrometheusUnavailable(f"cannot reach Prometheus at {url}: {exc!r}") from exc
            return _parse_vector(resp, expr)

        ratios = run(q.ratio)
        return _combine(ratios, run(q.sample_time) if q.sample_time else None)
    finally:
        if own:
            c.close()


async def aquery_card_ratios(prom_url: str, query: CardMemoryQuery | str, timeout: float = 5.0,
                             *, at: float | None = None,
                             client: httpx.AsyncClient | None = None
                             ) -> dict[CardKey, CardReading]:
    """``query_card_ratios`` for an event loop (the governor is an async Serve deployment, and
    a blocking query would stall the replicas' limit pulls for up to ``timeout``)."""
    q = _as_query(query)
    url = prom_url.rstrip("/") + "/api/v1/query"
    own = client is None
    c = client or httpx.AsyncClient(timeout=timeout)
    try:
        async def run(expr: str) -> list[tuple[CardKey, float, float]]:
            try:
                resp = await c.get(url, params=_params(expr, timeout, at), timeout=timeout)
            except httpx.HTTPError as exc:
                raise PrometheusUnavailable(f"cannot reach Prometheus at {url}: {exc!r}") from exc
            return _parse_vector(resp, expr)

        ratios = await run(q.ratio)
        return _combine(ratios, await run(q.sample_time) if q.sample_time else None)
    finally:
        if own:
            await c.aclose()
