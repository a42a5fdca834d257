"""CardMemorySampler: the CPU path against real processes; device paths against stand-in drivers
(no NPU or GPU on these machines), which checks the lazy imports and the (free, total) order."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import types

import pytest

from deployments.card_memory import CardMemorySampler, CardMemoryUnavailable
from deployments.config import parse_config

MB = 1 << 20
ALLOC_MB = 160

# A child that allocates ALLOC_MB (touched, so it is resident), starts a grandchild doing the
# same, says "ready" once both hold their memory, and exits when stdin closes.
CHILD = textwrap.dedent(f"""
    import subprocess, sys
    held = b"\\x01" * ({ALLOC_MB} << 20)
    if sys.argv[1:] == ["spawn"]:
        grand = subprocess.Popen([sys.executable, "-c", {{code!r}}], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE)
        assert grand.stdout.readline().strip() == b"ready"
    print("ready", flush=True)
    sys.stdin.read()
""")
GRANDCHILD = (f'import sys; held = b"\\x01" * ({ALLOC_MB} << 20); print("ready", flush=True); '
              "sys.stdin.read()")


def cpu_sampler(pid: int | None = None) -> CardMemorySampler:
    return CardMemorySampler("cpu", cpu_capacity_bytes=4 << 30, pid=pid)


def wait_for(fetch, done, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    value = fetch()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.05)
        value = fetch()
    return value


def test_cpu_sampler_sees_child_and_grandchild_processes_grow():
    sampler = cpu_sampler()
    before, total = sampler.sample()
    assert total == 4 << 30 and before > 0
    code = CHILD.replace("{code!r}", repr(GRANDCHILD))
    child = subprocess.Popen([sys.executable, "-c", code, "spawn"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"ready"
        grown, _ = sampler.sample()
        # Two processes each holding ALLOC_MB; allow for the test process' own drift.
        assert grown - before >= 2 * ALLOC_MB * MB * 0.9, (before // MB, grown // MB)
        # Sampling from the child's pid covers its descendants too (vLLM's engine core spawns
        # its workers in turn).
        child_only, _ = cpu_sampler(child.pid).sample()
        assert child_only >= 2 * ALLOC_MB * MB * 0.9
    finally:
        child.stdin.close()
        child.wait(10)
    after = wait_for(lambda: sampler.sample()[0], lambda used: used - before < ALLOC_MB * MB)
    assert after - before < ALLOC_MB * MB, "memory of exited children still counted"


def test_cpu_sampler_from_config_uses_the_configured_capacity():
    cfg = parse_config({"platform": {"kind": "cpu", "cpu_card_memory_bytes": 123 * MB},
                        "models": [{"name": "m", "source": {"path": "/nonexistent"}}]})
    used, total = CardMemorySampler.from_config(cfg).sample()
    assert total == 123 * MB and used > 0


def test_cpu_path_needs_a_capacity_and_never_imports_device_libraries():
    with pytest.raises(ValueError, match="cpu_capacity_bytes"):
        CardMemorySampler("cpu")
    with pytest.raises(ValueError, match="unknown platform"):
        CardMemorySampler("npu")  # type: ignore[arg-type]
    cpu_sampler().sample()
    assert "torch_npu" not in sys.modules


def test_a_vanished_process_is_unavailable_not_zero():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(CardMemoryUnavailable, match=str(proc.pid)):
        cpu_sampler(proc.pid).sample()


def test_ascend_path_reads_torch_npu_lazily(monkeypatch):
    # mem_get_info returns (free, total), like torch.cuda's.
    npu = types.SimpleNamespace(mem_get_info=lambda: (24 << 30, 64 << 30))
    fake = types.SimpleNamespace(npu=npu)
    sampler = CardMemorySampler("ascend")  # constructing it imports nothing
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    assert sampler.sample() == (40 << 30, 64 << 30)


def test_cuda_path_reads_torch_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (1 << 30, 16 << 30))
    assert CardMemorySampler("cuda").sample() == (15 << 30, 16 << 30)


def test_driver_errors_surface_as_card_memory_unavailable(monkeypatch):
    import torch

    def broken():
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    with pytest.raises(CardMemoryUnavailable, match="driver initialization"):
        CardMemorySampler("cuda").sample()
