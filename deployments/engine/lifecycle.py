"""Starting and stopping a replica's engines: through the injected factory, with a reaper.

An engine is built through an import path (``engine_factory``: the real vLLM engine, or a test's
fault injector around it), its processes are watched by a reaper so they never outlive the
replica, and shutting it down waits until those processes are gone: on a card their exit is
what frees the memory the next engine's start-up check needs. Processes that outlive a clean
shutdown are SIGKILLed and waited for again: a killed process keeps its card memory until the
driver has torn it down, so the next engine must not start before they are gone.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

from . import reaper
from .vllm_engine import EmbeddingEngine

logger = logging.getLogger("embedfleet.engine")

DEFAULT_ENGINE_FACTORY = "embedfleet.deployments.engine.vllm_engine:VllmEmbeddingEngine"
# A clean shutdown of vLLM's engine core and workers takes seconds; past this they are killed.
EXIT_WAIT_S = 60.0
# After SIGKILL, the driver still has to release a dead process's card memory (seconds on a
# busy NPU); past this the swap goes on and the new engine's own free-memory check decides.
KILL_WAIT_S = 60.0


def load_factory(path: str) -> Callable[[dict[str, Any]], EmbeddingEngine]:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


class EngineLifecycle:
    def __init__(self, factory_path: str,
                 engine_kwargs: Callable[[bool], dict[str, Any]], *,
                 exit_wait_s: float = EXIT_WAIT_S, kill_wait_s: float = KILL_WAIT_S) -> None:
        self._factory = load_factory(factory_path)
        self._kwargs = engine_kwargs
        self._procs: dict[int, tuple[list[int], Any]] = {}
        self._exit_wait_s = exit_wait_s
        self._kill_wait_s = kill_wait_s

    def build(self, prefix_cache: bool) -> EmbeddingEngine:
        os.environ[reaper.MARKER_ENV] = str(os.getpid())  # inherited by the engine's processes
        before = set(reaper.engine_pids())
        engine = self._factory(self._kwargs(prefix_cache))
        new = [p for p in reaper.engine_pids() if p not in before]
        # The watchdog kills them all should the replica die; shutdown waits only for the
        # engine's own: the first engine's start also starts multiprocessing's resource tracker,
        # which serves the whole replica, holds no card memory and exits only with it (waiting
        # for it cost every first swap the full EXIT_WAIT_S).
        pids = [p for p in new if not reaper.is_resource_tracker(p)]
        self._procs[id(engine)] = (pids, reaper.start_reaper(new))
        return engine

    def shutdown(self, engine: EmbeddingEngine) -> list[int]:
        """Shut ``engine`` down and wait for its processes; the pids still alive (empty when
        the card's memory is free)."""
        pids, watchdog = self._procs.pop(id(engine), ([], None))
        engine.shutdown()
        left = reaper.wait_gone(pids, timeout_s=self._exit_wait_s)
        if left:
            logger.warning("engine processes %s outlived shutdown by %.0f s; killing them",
                           left, self._exit_wait_s)
            reaper.kill_engine_processes(left)
            left = reaper.wait_gone(left, timeout_s=self._kill_wait_s)
            if left:
                logger.error("engine processes %s still alive %.0f s after SIGKILL (stuck in "
                             "the driver?); their card memory may not be free for the next "
                             "engine", left, self._kill_wait_s)
        if watchdog is not None:
            watchdog.terminate()
        gc.collect()
        return left

    def stop_watchdogs(self) -> None:
        for _, watchdog in self._procs.values():
            if watchdog is not None:
                watchdog.terminate()
