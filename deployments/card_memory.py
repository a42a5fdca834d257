"""CardMemorySampler: how full this replica's card is, as (used_bytes, total_bytes).

The replica exports the two numbers as ``embedfleet_card_memory_used_bytes`` /
``embedfleet_card_memory_total_bytes`` (labels node, device); Prometheus' recording rule
``card:embedfleet_memory:ratio`` divides them and the memory governor reads that rule.

Per platform:

* ``ascend``: ``torch_npu.npu.mem_get_info()`` — free and total HBM of the card as the driver
  sees it, so it counts every process on the card (the vLLM engine core runs in a child process,
  not in the replica). ``torch_npu`` is imported on first use only: importing it on a machine
  without the CANN runtime fails, and the CPU and CUDA paths must never need it.
* ``cuda``: ``torch.cuda.mem_get_info()``, same meaning.
  Caveat for both: the first call creates a device context in the *replica* process (a few hundred
  MB of card memory on top of the engine's). It is counted in what the governor sees, which errs on
  the cautious side; a context-free reader (NVML / DCMI) can replace it without changing callers.
* ``cpu``: there is no card, so the "card" is the engine: resident memory (RSS) of the replica
  process plus all its descendants (vLLM's engine-core and worker processes), against the
  configured capacity ``platform.cpu_card_memory_bytes``. Summing RSS counts pages shared between
  the processes (shared libraries, copy-on-write after fork) more than once, so it overstates use:
  the governor brakes a little early, never late. Exact per-process shares (PSS) would need a
  full read of ``/proc/*/smaps`` each sample, too slow for a multi-GB engine every few seconds.

Relies on ``psutil`` for the CPU path (installed with vLLM and Ray).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from deployments.config import EmbedfleetConfig

Platform = Literal["cpu", "cuda", "ascend"]


class CardMemoryUnavailable(RuntimeError):
    """The card's memory could not be read (driver error, process gone). Transient for the
    caller: skip this sample; the governor holds the card's limits while the series is missing."""


class CardMemorySampler:
    """Reads (used_bytes, total_bytes) for this replica's card; cheap enough to call each second."""

    def __init__(self, platform: Platform, *, cpu_capacity_bytes: int | None = None,
                 pid: int | None = None) -> None:
        if platform not in ("cpu", "cuda", "ascend"):
            raise ValueError(f"unknown platform {platform!r}; expected cpu, cuda or ascend")
        if platform == "cpu" and not (cpu_capacity_bytes and cpu_capacity_bytes > 0):
            raise ValueError("platform 'cpu' needs cpu_capacity_bytes > 0 (the configured "
                             f"platform.cpu_card_memory_bytes), got {cpu_capacity_bytes!r}")
        self.platform: Platform = platform
        self.cpu_capacity_bytes = cpu_capacity_bytes
        self.pid = os.getpid() if pid is None else pid

    @classmethod
    def from_config(cls, cfg: EmbedfleetConfig, pid: int | None = None) -> CardMemorySampler:
        return cls(cfg.platform.kind, cpu_capacity_bytes=cfg.platform.cpu_card_memory_bytes,
                   pid=pid)

    def sample(self) -> tuple[int, int]:
        """(used_bytes, total_bytes). Raises ``CardMemoryUnavailable`` when it cannot read."""
        try:
            if self.platform == "cpu":
                return self._process_tree_rss(), int(self.cpu_capacity_bytes or 0)
            free, total = self._device_mem_get_info()
        except CardMemoryUnavailable:
            raise
        except Exception as exc:  # driver and psutil errors vary by version; one type for callers
            raise CardMemoryUnavailable(
                f"cannot read {self.platform} card memory: {type(exc).__name__}: {exc}") from exc
        return int(total) - int(free), int(total)

    def _device_mem_get_info(self) -> tuple[int, int]:
        # Ray makes the replica's card the only visible device, so the current device is the card.
        if self.platform == "ascend":
            import torch_npu  # lazy: see the module docstring

            return torch_npu.npu.mem_get_info()
        import torch

        return torch.cuda.mem_get_info()

    def _process_tree_rss(self) -> int:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error as exc:
            raise CardMemoryUnavailable(f"replica process {self.pid}: {exc}") from exc
        total = 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
            except psutil.Error:  # a worker that exited between listing and reading: not in use
                continue
        return total
