"""A CPU "card" gets its cores and one OpenMP thread per core, idle threads sleeping
(deployments/engine/platform.py).

Ray sets OMP_NUM_THREADS to an actor's num_cpus before the replica's code runs: 1 for the engine
replica, which reserves no Ray CPU. The engine core inherits the replica's environment, so
without the override its torch ran every forward pass on one thread, half the card's speed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from embedfleet.deployments.engine import platform


@pytest.fixture
def ray_worker_env(monkeypatch):
    """A replica process as Ray starts it on a 4-core node: OMP_NUM_THREADS=1, no binding."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("LD_PRELOAD", "")  # the tests set it: restored (or unset) after
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})


def test_each_card_gets_its_cores_and_a_thread_per_core(ray_worker_env):
    assert platform.prepare_cpu_process("1", cards_on_node=2) == "2,3"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "2,3"
    assert os.environ["OMP_NUM_THREADS"] == "2"  # not Ray's 1
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"  # idle threads sleep, not spin


def test_an_operators_binding_wins_and_sets_the_thread_count(ray_worker_env, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-2")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert platform.prepare_cpu_process("0", cards_on_node=1) == "0-2"
    assert os.environ["OMP_NUM_THREADS"] == "3" and os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")  # vLLM picks: every core we have
    platform.prepare_cpu_process("0", cards_on_node=1)
    assert os.environ["OMP_NUM_THREADS"] == "4"


@pytest.mark.parametrize("binding, cores", [("0", 1), ("0,1", 2), ("0-7", 8), ("0-3,8-11", 8),
                                            ("0-7|8-15", 8), ("auto", None), ("nobind", None),
                                            ("0-x", None), ("", None)])
def test_bound_cores_reads_vllms_binding_syntax(binding, cores):
    assert platform.bound_cores(binding) == cores


# -- the engine's malloc ---------------------------------------------------------------------------

TCM = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
GOMP = "/venv/torch/lib/libgomp.so.1"


@pytest.mark.parametrize("preload, want", [
    ("", TCM),
    (GOMP, f"{TCM}:{GOMP}"),  # first, as vLLM's CPU platform puts its bundled one
    (f"/opt/libjemalloc.so.2:{GOMP}", f"/opt/libjemalloc.so.2:{GOMP}"),  # an operator's choice
    (f"{TCM}:{GOMP}", f"{TCM}:{GOMP}"),  # already there: not twice
])
def test_tcmalloc_goes_first_in_ld_preload_unless_an_allocator_is_there(preload, want):
    assert platform.cpu_malloc_preload(preload, TCM) == want


def test_without_tcmalloc_installed_the_preload_is_left_as_it_is(tmp_path):
    assert platform.find_tcmalloc((str(tmp_path),)) is None
    assert platform.cpu_malloc_preload(GOMP, None) == GOMP
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert platform.find_tcmalloc((str(tmp_path),)) == str(tmp_path / "libtcmalloc_minimal.so.4")


def test_a_replica_preloads_tcmalloc_for_its_engine(ray_worker_env, monkeypatch, tmp_path):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    monkeypatch.setattr(platform, "LIB_DIRS", (str(tmp_path),))
    monkeypatch.setenv("LD_PRELOAD", GOMP)
    platform.prepare_cpu_process("0", cards_on_node=1)
    assert os.environ["LD_PRELOAD"] == f"{lib}:{GOMP}"


IDLE_PROBE = """
from embedfleet.deployments.engine.vllm_api import _malloc_trim
def rss_mb():
    return next(int(x.split()[1]) // 1024 for x in open("/proc/self/status") if x.startswith("VmRSS:"))
blocks = [bytearray(b"x" * (1 << 20)) for _ in range(400)]
del blocks
before = rss_mb()
_malloc_trim()
print(before, rss_mb(), "libtcmalloc" in open("/proc/self/maps").read())
"""


def test_the_idle_memory_probe_hands_tcmallocs_free_pages_back():
    """tcmalloc keeps freed pages (400 MB here) where glibc's malloc_trim cannot reach them; the
    idle probe (vllm_api._malloc_trim) calls tcmalloc's own release, so an idle card reads idle."""
    tcmalloc = platform.find_tcmalloc()
    assert tcmalloc, "libtcmalloc-minimal4 is not installed (make setup installs it)"
    out = subprocess.run([sys.executable, "-c", IDLE_PROBE], capture_output=True, text=True,
                         env={**os.environ, "LD_PRELOAD": tcmalloc}, timeout=120, check=True)
    before, after, loaded = out.stdout.split()
    assert loaded == "True"
    assert int(before) - int(after) >= 300, out.stdout  # held by tcmalloc, then handed back
