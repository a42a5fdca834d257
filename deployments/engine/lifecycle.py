"""Starting and stopping a replica's engines: through the injected factory, with a reaper.

An engine is built through an import path (``engine_factory``: the real vLLM engine, or a test's
fault injector around it), its processes are watched by a reaper so they never outlive the
replica, and shutting it down waits until those processes are gone: on a card their exit is
what frees the memory the next engine's start-up check needs.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

from embedfleet.deployments.engine import reaper
from embedfleet.deployments.engine.vllm_engine import EmbeddingEngine

logger = logging.getLogger("embedfleet.engine")

DEFAULT_ENGINE_FACTORY = "embedfleet.deployments.engine.vllm_engine:VllmEmbeddingEngine"


def load_factory(path: str) -> Callable[[dict[str, Any]], EmbeddingEngine]:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


class EngineLifecycle:
    def __init__(self, factory_path: str,
                 engine_kwargs: Callable[[bool], dict[str, Any]]) -> None:
        self._factory = load_factory(factory_path)
        self._kwargs = engine_kwargs
        self._procs: dict[int, tuple[list[int], Any]] = {}

    def build(self, prefix_cache: bool) -> EmbeddingEngine:
        os.environ[reaper.MARKER_ENV] = str(os.getpid())  # inherited by the engine's processes
        before = set(reaper.engine_pids())
        engine = self._factory(self._kwargs(prefix_cache))
        pids = [p for p in reaper.engine_pids() if p not in before]
        self._procs[id(engine)] = (pids, reaper.start_reaper(pids))
        return engine

    def shutdown(self, engine: EmbeddingEngine) -> None:
        pids, watchdog = self._procs.pop(id(engine), ([], None))
        engine.shutdown()
        left = reaper.wait_gone(pids, timeout_s=60)
        if left:
            logger.warning("engine processes %s outlived shutdown; killed", left)
            reaper.kill_engine_processes(left)
        if watchdog is not None:
            watchdog.terminate()
        gc.collect()

    def stop_watchdogs(self) -> None:
        for _, watchdog in self._procs.values():
            if watchdog is not None:
                watchdog.terminate()
