"""Settings from the environment, all under the ``EMBEDFLEET_`` prefix, read once at start-up."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

PREFIX = "EMBEDFLEET_"


@dataclass(frozen=True)
class Settings:
    state_dir: Path          # pid files, Prometheus data, rendered configs of `embedfleet up`
    ray_port: int            # GCS port of the local head `embedfleet up` starts
    dashboard_port: int      # Ray dashboard (Serve's REST deploy API lives there)
    prometheus_port: int
    ready_timeout_s: float   # how long `up`/`deploy` wait for every model to have a replica


def _env(name: str, default: str) -> str:
    return os.environ.get(PREFIX + name, default)


@functools.cache
def settings() -> Settings:
    return Settings(
        state_dir=Path(_env("STATE_DIR", str(Path.home() / ".embedfleet"))),
        ray_port=int(_env("RAY_PORT", "6379")),
        dashboard_port=int(_env("DASHBOARD_PORT", "8265")),
        prometheus_port=int(_env("PROMETHEUS_PORT", "9090")),
        ready_timeout_s=float(_env("READY_TIMEOUT_S", "900")),
    )
