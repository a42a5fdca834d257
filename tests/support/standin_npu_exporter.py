"""STAND-IN npu-exporter — FOR TESTS AND DEMOS ONLY. IT READS NO HARDWARE.

Every value it serves was set by a test or a person, over HTTP or through the Python API. It
exists so that embedfleet's memory governor can be exercised end to end — real Prometheus
scraping, real PromQL, real HTTP API — on machines without Ascend cards. On real Ascend nodes run
Huawei's npu-exporter instead; never point production Prometheus at this.

What it imitates from npu-exporter: the metric names ``npu_chip_info_hbm_used_memory`` and
``npu_chip_info_hbm_total_memory`` (gauges, MB), the chip label ``id`` (physical device id), and
optionally explicit sample timestamps (npu-exporter stamps samples with its cache-update time,
which is how a stuck exporter shows up as old samples rather than missing ones).
Where it differs: it also labels each series with ``node``, so one process can stand in for
several nodes (a real npu-exporter runs per node and the scrape config attaches the node), and
it serves ``standin_npu_exporter_info`` so a stand-in can never be mistaken for the real thing.
The engine's terms of the governor's live ratio (free KV pool, allocator cache) never come from
an npu-exporter but from the replicas through Ray; in tests the STAND-IN
``tests.support.standin_ray_agent`` serves them.

HTTP API (JSON bodies):
  GET  /metrics                       Prometheus text format
  POST /set    {"node", "device", "used", "total", "timestamp"?}   used/total in MB;
               timestamp (unix s) is sent with the samples if given, else Prometheus stamps them
  POST /ratio  {"node", "device", "ratio", "total"?}                sets used = ratio * total
  POST /remove {"node"?, "device"?}   drops one card's series (or all, with an empty body)
  GET  /cards                         the current values as JSON

Run: ``python -m tests.support.standin_npu_exporter --port 9101 --card n0:0:0.5 …``
"""

from __future__ import annotations

import argparse
import signal
import threading
from dataclasses import asdict, dataclass
from typing import Any

from tests.support.standin_exporter import StandinExporter, info_lines, label

USED = "npu_chip_info_hbm_used_memory"
TOTAL = "npu_chip_info_hbm_total_memory"
INFO = "standin_npu_exporter_info"
#: 64 GB of HBM, a 910B card, in MB (npu-exporter's unit).
DEFAULT_TOTAL_MB = 65536.0

_ABOUT = __doc__ or ""  # served at GET /
_BANNER = "STAND-IN for tests/demos, not real hardware data"


@dataclass(frozen=True)
class Card:
    node: str
    device: str
    used: float
    total: float
    timestamp: float | None = None


def render(cards: list[Card]) -> str:
    """The exposition text for these cards (Prometheus text format 0.0.4)."""
    lines = info_lines(INFO, _BANNER, "embedfleet's stand-in npu-exporter")
    for name, attr, what in ((USED, "used", "hbm used memory"),
                             (TOTAL, "total", "hbm total memory")):
        lines += [f"# HELP {name} {_BANNER}: the npu {what} (MB), set by a test.",
                  f"# TYPE {name} gauge"]
        for c in cards:
            labels = f'id="{label(c.device)}",node="{label(c.node)}"'
            sample = f"{name}{{{labels}}} {getattr(c, attr)!r}"
            if c.timestamp is not None:
                sample += f" {int(c.timestamp * 1000)}"  # text format timestamps are in ms
            lines.append(sample)
    return "\n".join(lines) + "\n"


class StandinNpuExporter(StandinExporter[Card]):
    """The STAND-IN npu-exporter (``StandinExporter``: its card store and HTTP server)."""

    thread_name = "standin-npu-exporter"
    about = _ABOUT

    def render(self, cards: list[Card]) -> str:
        return render(cards)

    def set_card(self, node: str, device: str | int, used: float, total: float,
                 timestamp: float | None = None) -> Card:
        if not total > 0 or used < 0:
            raise ValueError(f"need used >= 0 and total > 0, got used={used} total={total}")
        card = Card(str(node), str(device), float(used), float(total),
                    None if timestamp is None else float(timestamp))
        with self._lock:
            self._cards[(card.node, card.device)] = card
        return card

    def set_ratio(self, node: str, device: str | int, ratio: float,
                  total: float = DEFAULT_TOTAL_MB, timestamp: float | None = None) -> Card:
        return self.set_card(node, device, ratio * total, total, timestamp)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        if path == "/set":
            return asdict(self.set_card(body["node"], body["device"], body["used"],
                                        body["total"], body.get("timestamp")))
        if path == "/ratio":
            return asdict(self.set_ratio(body["node"], body["device"], body["ratio"],
                                         body.get("total", DEFAULT_TOTAL_MB),
                                         body.get("timestamp")))
        return super().post(path, body)


def _parse_card(spec: str) -> tuple[str, str, float]:
    node, device, ratio = spec.split(":")
    return node, device, float(ratio)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="STAND-IN npu-exporter for tests and demos only: serves HBM memory values "
                    "that you set, not real hardware data.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9101, help="npu-exporter's usual port")
    parser.add_argument("--card", action="append", default=[], type=_parse_card,
                        metavar="NODE:DEVICE:RATIO", help="initial card (repeatable)")
    args = parser.parse_args(argv)
    exporter = StandinNpuExporter(args.host, args.port)
    for node, device, ratio in args.card:
        exporter.set_ratio(node, device, ratio)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    exporter.start()
    print(f"STAND-IN npu-exporter (tests/demos only) on {exporter.url}/metrics", flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        exporter.stop()


if __name__ == "__main__":
    main()
