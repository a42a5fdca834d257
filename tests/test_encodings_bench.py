"""`embedfleet bench`'s bytes per vector (benchmarks/encodings_bench.py), measured from the
Router's real answers served in process over stand-in model calls (tests/test_encodings_routes.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from embedfleet.benchmarks import report as rpt
from embedfleet.benchmarks.encodings_bench import (ENCODINGS, encodings_lines,
                                                   measure_encodings, stored_bytes)
from tests.test_encodings_routes import DIM, MODEL, served  # noqa: F401 - the fixture


def test_bytes_per_vector_are_measured_from_the_answers(served):  # noqa: F811
    client, _ = served
    transport = httpx.ASGITransport(app=client.app)  # the test client's app, in process
    out = asyncio.run(measure_encodings("http://bench", MODEL, [f"text {i}" for i in range(5)],
                                        transport=transport))
    assert out["status"] == "ok" and out["dimensions"] == DIM and out["texts"] == 5
    per = out["per_encoding"]
    assert list(per) == list(ENCODINGS)
    assert {e: per[e]["bytes_per_vector"] for e in per} == {
        "float": 4 * DIM, "base64": 4 * DIM, "int8": DIM, "uint8": DIM,
        "binary": DIM // 8, "ubinary": DIM // 8}
    assert per["binary"]["json_bytes_per_vector"] < per["int8"]["json_bytes_per_vector"] \
        < per["float"]["json_bytes_per_vector"]
    assert out["int8_ranges"].startswith("calibration:")
    (line,) = encodings_lines(out)
    assert f"{DIM}-d" in line and f"ubinary {DIM // 8}" in line


def test_a_wrong_answer_shows_or_fails():
    assert stored_bytes("int8", [1, -2, 3]) == 3
    with pytest.raises(ValueError, match="non-integers"):
        stored_bytes("int8", [0.5, 1.0])
    with pytest.raises(ValueError, match="outside"):
        stored_bytes("int8", [200])
    out = asyncio.run(measure_encodings("http://127.0.0.1:9", MODEL, ["a"], timeout_s=2))
    assert out["status"] == "failed" and out["reason"]
    assert encodings_lines(out)[0].startswith("bytes per vector: failed")
    assert encodings_lines(None) == []


def test_the_report_carries_the_section():
    r = rpt.build_report(command=[], started_at="", finished_at="", machine={}, settings={},
                         workloads={}, peers={}, runs=[], skipped=[], probes={},
                         prefix_cache=None, encodings={"status": "ok"})
    assert r["encodings"] == {"status": "ok"} and rpt.check_schema(r) == []
