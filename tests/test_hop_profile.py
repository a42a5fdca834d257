"""The hop profiler's arithmetic (benchmarks/hop_profile.py): alternation, medians, hop costs."""

from __future__ import annotations

import pytest

from embedfleet.benchmarks.hop_profile import (CLIENT, VARIANTS, Run, cpu_per_request, order,
                                               summarize, table)


def test_every_repeat_runs_each_way_once_and_the_first_way_rotates():
    n = len(VARIANTS)
    seq = order(n)
    assert len(seq) == n * n
    rounds = [seq[i:i + n] for i in range(0, n * n, n)]
    assert all(sorted(r) == sorted(VARIANTS) for r in rounds)
    assert len({r[0] for r in rounds}) == n  # no way in always runs first (or last)


def test_hops_are_differences_of_the_medians_over_repeats():
    runs = [Run("http", [40, 50, 60]), Run("http", [44, 45, 46]), Run("http", [100, 100, 100]),
            Run("router-handle", [30, 30, 30]), Run("router-handle", [35, 35, 35]),
            Run("router-handle", [31, 31, 31]),
            Run("replica-handle", [12, 12, 12]), Run("replica-handle", [13, 13, 13]),
            Run("replica-handle", [10, 10, 10]),
            Run("replica-object-store", [15, 15, 15]), Run("replica-object-store", [16, 16, 16])]
    s = summarize(runs)
    assert s["variants"]["http"]["p50_ms"] == 50  # median of the runs' p50s 50, 45, 100
    assert s["variants"]["router-handle"]["p50_ms"] == 31
    assert s["variants"]["replica-handle"]["p50_ms"] == 12
    hops = {h["hop"]: h["p50_ms"] for h in s["hops"]}
    assert hops == {"HTTP + ingress": 19, "Router (its work + its handle call)": 19,
                    "replica + vLLM engine": 12}
    assert sum(hops.values()) == s["variants"]["http"]["p50_ms"]
    assert "| HTTP + ingress | 19.0 |" in table(s)
    # the transport is priced on the replica's handle, apart from the hops: 15.5 - 12
    assert s["transport"]["p50_ms"] == 3.5 and s["transport"]["cpu_ms_per_request"] is None
    assert "object store instead of gRPC (replica's handle): +3.5 ms p50" in table(s)


def test_cpu_is_per_request_per_group_with_the_client_apart():
    usage = {"scopes": {"cluster": {"cpu_s": 3.0, "processes": 40,
                                    "by_group": {"serve proxy": 1.0, "embedfleet:Router": 2.0}},
                        "client": {"cpu_s": 0.5}}}
    assert cpu_per_request(usage, 100) == {"serve proxy": 10.0, "embedfleet:Router": 20.0,
                                           CLIENT: 5.0}
    runs = [Run(v, [1.0], cpu_per_request(usage, 100)) for v in VARIANTS]
    assert summarize(runs)["variants"]["http"]["cpu_ms_per_request_total"] == 35.0
    assert summarize(runs)["transport"]["cpu_ms_per_request"] == 0.0


def test_a_cluster_whose_processes_were_not_found_is_unmeasured_never_zero_cpu():
    usage = {"scopes": {"cluster": {"cpu_s": 0.0, "processes": 0, "by_group": {}},
                        "client": {"cpu_s": 0.5}}}
    assert cpu_per_request(usage, 100) is None
    s = summarize([Run(v, [1.0], None) for v in VARIANTS])
    assert s["variants"]["http"]["cpu_ms_per_request"] is None
    assert s["variants"]["http"]["cpu_ms_per_request_total"] is None
    assert "| http | 1.0 | 1.0 | unmeasured |" in table(s)


def test_a_way_in_that_never_ran_is_an_error_not_a_zero_hop():
    with pytest.raises(ValueError, match="replica-handle"):
        summarize([Run("http", [5.0]), Run("router-handle", [3.0])])
