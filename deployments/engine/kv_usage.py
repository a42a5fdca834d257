"""Peak KV-cache usage of one engine over a sliding window: the KV term of the governor's signal.

Pure bookkeeping on numbers vLLM's scheduler statistics carry; the stat logger that feeds it
(``vllm_api.stat_logger_factory``) is the only part that touches vLLM, and lives with every other
vLLM touch point. ``card_memory`` turns a ``KvSample`` into the governor's signal.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import NamedTuple


class KvSample(NamedTuple):
    pool_bytes: int
    """Bytes of the engine's KV-cache pool (reserved at start-up, whatever is in use)."""
    peak_usage: float
    """Highest fraction of the pool in use during the window, including blocks that requests
    finishing in a step held during that step."""
    running: int
    waiting: int


class KvUsageTracker:
    """Peak KV-cache usage over a sliding window, from vLLM's own scheduler statistics.

    vLLM computes ``SchedulerStats.kv_cache_usage`` after a step has freed the blocks of the
    requests that finished in it. A pooling request finishes in the step that prefills it, so
    under embedding load that number reads ~0 while the step itself filled the pool (measured
    here: 0.0 at 16,380 tokens per step). The tracker adds back, per step, the blocks of the
    requests that finished in it (their uncached tokens, plus the longest cached prefix once:
    shared prefix blocks are counted once in the pool), so a long prefill's spike is seen.
    """

    def __init__(self, window_s: float = 15.0, clock=time.monotonic) -> None:
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()  # record() runs on vLLM's output loop; take() on ours
        self._peaks: deque[tuple[float, float]] = deque()  # (second, peak in that second)
        self._running = self._waiting = 0
        self.num_blocks = 0
        self.block_size = 0
        self.block_bytes = 0

    def configure(self, num_blocks: int, block_size: int, block_bytes: int) -> None:
        self.num_blocks, self.block_size, self.block_bytes = num_blocks, block_size, block_bytes

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def in_step_usage(self, after_free: float, finished: list[tuple[int, int]]) -> float:
        """Pool usage during a step: vLLM's post-step usage plus the finished requests' blocks.

        ``finished``: (prompt tokens, cached tokens) of each request that finished in the step."""
        if self.num_blocks <= 1 or self.block_size <= 0:
            return after_free
        blocks = sum(math.ceil(max(0, n - c) / self.block_size) for n, c in finished)
        blocks += max((c // self.block_size for _, c in finished), default=0)
        return min(1.0, after_free + blocks / self.num_blocks)

    def observe(self, usage: float, running: int, waiting: int) -> None:
        now = self._clock()
        second = math.floor(now)
        with self._lock:
            self._running, self._waiting = running, waiting
            if self._peaks and self._peaks[-1][0] == second:
                if usage > self._peaks[-1][1]:
                    self._peaks[-1] = (second, usage)
            else:
                self._peaks.append((second, usage))
            while self._peaks and self._peaks[0][0] < now - self._window_s:
                self._peaks.popleft()

    def sample(self) -> KvSample:
        now = self._clock()
        with self._lock:
            recent = [u for s, u in self._peaks if s >= now - self._window_s]
            return KvSample(self.pool_bytes, max(recent, default=0.0), self._running,
                            self._waiting)
