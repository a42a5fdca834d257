"""The ingress A/B tool's parts that need no cluster (benchmarks/ingress_ab.py)."""

from __future__ import annotations

import pytest

from embedfleet.benchmarks import ingress_ab
from embedfleet.benchmarks.process_cpu import Proc


def _p(pid: int, title: str, cpu: float, created: float = 100.0) -> Proc:
    return Proc(pid=pid, ppid=1, create_time=created, title=title, cmdline=(title,),
                own_s=cpu, reaped_s=0.0)


def test_each_run_gets_the_bundled_config_with_its_ingress():
    for mode in ingress_ab.MODES:
        data = ingress_ab.ingress_config(mode)
        assert data["router"]["http_ingress"] == mode
        assert data["models"][0]["name"] == "all-minilm-l6-v2"
    with pytest.raises(Exception, match="http_ingress"):
        ingress_ab.ingress_config("nginx")


def test_cpu_is_the_delta_per_title_and_a_reused_pid_counts_in_full():
    before = {1: _p(1, "ray::ProxyActor", 5.0), 2: _p(2, "haproxy", 1.0)}
    after = {1: _p(1, "ray::ProxyActor", 7.5), 2: _p(2, "haproxy", 0.5, created=200.0),
             3: _p(3, "VLLM::Worker", 4.0)}
    assert ingress_ab.cpu_by_title(before, after) == {"ray::ProxyActor": 2.5, "haproxy": 0.5,
                                                      "VLLM::Worker": 4.0}


def test_summary_is_the_median_per_mode():
    runs = [{"mode": m, "texts_per_s": t, "p50_ms": 1.0, "cpu_s_per_1k": c}
            for m, t, c in [("haproxy", 90, 20), ("serve_proxy", 60, 33), ("haproxy", 100, 21),
                            ("serve_proxy", 50, 30), ("haproxy", 95, 19)]]
    s = ingress_ab.summarize(runs)
    assert s["haproxy"] == {"texts_per_s": 95, "p50_ms": 1.0, "cpu_s_per_1k": 20, "runs": 3}
    assert s["serve_proxy"]["texts_per_s"] == 55 and s["serve_proxy"]["runs"] == 2
