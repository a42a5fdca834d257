"""A CPU "card" gets its cores and one OpenMP thread per core, idle threads sleeping
(deployments/engine/platform.py).

Ray sets OMP_NUM_THREADS to an actor's num_cpus before the replica's code runs: 1 for the engine
replica, which reserves no Ray CPU. The engine core inherits the replica's environment, so
without the override its torch ran every forward pass on one thread, half the card's speed."""

from __future__ import annotations

import os

import pytest

from embedfleet.deployments.engine import platform


@pytest.fixture
def ray_worker_env(monkeypatch):
    """A replica process as Ray starts it on a 4-core node: OMP_NUM_THREADS=1, no binding."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
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
