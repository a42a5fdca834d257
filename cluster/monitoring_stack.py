"""The Prometheus that `embedfleet up` runs beside the local cluster.

It scrapes Ray's metrics agents through Ray's file service discovery (so the replicas' and the
router's `embedfleet_*` metrics arrive as `ray_embedfleet_*`), evaluates the shipped recording
rules and alerts, and is what the memory governor queries. It runs detached, with its pid file in
the state dir, so `embedfleet down` (another process) can stop it.
"""

from __future__ import annotations

import time

import httpx
import yaml

from .prometheus_server import (CONFIG_NAME, PrometheusStartError, find_binary, start_prometheus)
from .prometheus_server import stop_from_pidfile
from ..deployments.config.schema import EmbedfleetConfig
from ..deployments.common.settings import settings
from ..monitoring.prometheus.config import render_prometheus_config


def _data_dir():
    return settings().state_dir / "prometheus"


def prometheus_url() -> str:
    return f"http://127.0.0.1:{settings().prometheus_port}"


def start_monitoring(cfg: EmbedfleetConfig) -> str | None:
    """Start Prometheus unless one of ours already answers; returns its URL (None: no binary)."""
    try:
        find_binary()
    except (FileNotFoundError, PrometheusStartError):
        print("prometheus not found on PATH (install Debian's `prometheus`, or `make setup`); "
              "running without metrics storage")
        return None
    url = prometheus_url()
    text = render_prometheus_config(extra_targets=cfg.monitoring.npu_exporter_targets)
    if cfg.monitoring.scrape_interval_s:
        data = yaml.safe_load(text)
        data["global"]["scrape_interval"] = f"{cfg.monitoring.scrape_interval_s}s"
        data["global"]["evaluation_interval"] = f"{cfg.monitoring.scrape_interval_s}s"
        text = yaml.safe_dump(data, sort_keys=False)
    running = False
    for _ in range(3):  # a Prometheus busy replaying its WAL or under load answers slowly
        try:
            running = httpx.get(f"{url}/-/ready", timeout=3).status_code == 200
            break
        except httpx.HTTPError:
            time.sleep(1)
    if running:  # ours from an earlier `up`: give it this config (lifecycle API is enabled)
        config_file = _data_dir() / CONFIG_NAME
        if not config_file.exists() or config_file.read_text() != text:
            config_file.parent.mkdir(parents=True, exist_ok=True)
            config_file.write_text(text)
            httpx.post(f"{url}/-/reload", timeout=10).raise_for_status()
        return url
    # A restart replays the persistent TSDB's WAL: over 30 s on a busy 2-core machine.
    start_prometheus(text, _data_dir(), settings().prometheus_port, detach=True,
                     ready_timeout=180)
    return url


def stop_monitoring() -> bool:
    return stop_from_pidfile(_data_dir())
