"""`embedfleet bench --quick` in `make test`: a smoke test of the harness, no speed assertion.

Two peers of the issue's online goal really run, bare vLLM in-process and embedfleet over HTTP
(the session cluster), on the tiny seeded `short` (32 texts a request) and `online` (one text a
request, 16 in flight) workloads, and the run must write its JSON report and PNG chart. vLLM's own
OpenAI server (a third vLLM start: 6+ minutes on a starved machine) is left to `embedfleet bench`;
its flags are unit-tested. What would break if the harness broke: a peer that did not run, vectors that
disagree between peers, missing ratios or goals, no chart.

The run itself starts in the background early in the cluster tests
(tests/support/background_bench.py: most of it is the vLLM peer starting); this test waits
for it and reads what it wrote. Run alone, the test starts it.

Infinity (its own venv, a minute to start), the long/mixed/shared-instruction workloads and the
prefix-cache comparison (two more engines) are left to `embedfleet bench`: with them this test
took 5 to 12 minutes of `make test`'s 30.
"""

from __future__ import annotations

import json

import pytest

from embedfleet.benchmarks import report as rpt
from tests.support.background_bench import BACKGROUND_BENCH, PEERS, WORKLOADS

# After the other cluster tests (conftest orders by `late`): the run this test reads started
# beside the first ones, and every later cluster test waits for it to end.
pytestmark = [pytest.mark.cluster, pytest.mark.late(1)]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_quick_runs_every_peer_and_writes_json_and_png(cluster):
    # the run started in the background (tests/conftest.py), or now when this test runs alone
    BACKGROUND_BENCH.start(cluster)
    returncode = BACKGROUND_BENCH.wait()
    out = BACKGROUND_BENCH.out
    if returncode != 0:  # say which peer or run failed, not only the log's tail
        written = out / "report.json"
        why = json.loads(written.read_text())["problems"] if written.exists() else "no report"
        errors = ([r for r in json.loads(written.read_text())["runs"] if r["error"]]
                  if written.exists() else [])
        raise AssertionError(f"bench exited {returncode}; problems: {why}; failed runs: "
                             f"{errors}\n{BACKGROUND_BENCH.log_tail()}")
    report = json.loads((out / "report.json").read_text())
    assert rpt.check_schema(report) == [] and report["ok"] is True, report.get("problems")
    assert {p: s["status"] for p, s in report["peers"].items()} == {p: "ok" for p in PEERS}
    ran = {(r["workload"], r["peer"]) for r in report["runs"] if not r["error"]}
    assert ran == {(w, p) for w in WORKLOADS for p in PEERS}, ran
    for workload in WORKLOADS:
        summary = report["summary"][workload]
        for peer in PEERS:
            s = summary.get(peer)
            assert s and s["texts_per_s"] and s["texts_per_s"] > 0, (workload, peer, summary)
            assert s["p50_ms"] > 0 and s["p99_ms"] >= s["p50_ms"]
            assert s["cpu_s_per_1k"] and s["cpu_s_per_1k"] > 0, (workload, peer, s)
        assert summary["vllm"]["ratio_to_vllm"] == 1.0
        assert summary["embedfleet"]["ratio_to_vllm"] > 0
        for peer in PEERS:  # the same weights everywhere: the same vectors
            c = report["correctness"][workload][peer]
            assert c["ok"] and c["min_cosine"] >= 0.999, (workload, peer, c)
    assert report["ratios"]["embedfleet/vllm-serve"]["online"] is None  # vllm-serve did not run
    png = (out / "chart.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 5000
