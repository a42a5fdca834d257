"""The ingress A/B tool's parts that need no cluster (benchmarks/ingress_ab.py)."""

from __future__ import annotations

import pytest

from embedfleet.benchmarks import ingress_ab


def test_each_run_gets_the_bundled_config_with_its_ingress():
    for mode in ingress_ab.MODES:
        data = ingress_ab.ingress_config(mode)
        assert data["router"]["http_ingress"] == mode
        assert data["models"][0]["name"] == "all-minilm-l6-v2"
    with pytest.raises(Exception, match="http_ingress"):
        ingress_ab.ingress_config("nginx")


def test_each_run_is_the_benchs_online_workload_counted_by_the_models_tokenizer():
    from embedfleet.deployments.config.schema import load_config

    m = load_config().models[0]
    w, tokens = ingress_ab.online_workload(40, m.source.resolve(), m.max_model_len)
    assert w.name == "online" and len(w.texts) == 40 and w.batch == 1 and w.concurrency == 16
    # 3-20 words a query, plus [CLS] and [SEP]: the tokenizer counted every text
    assert 40 * 5 <= tokens <= 40 * 40
    runs = [{"mode": "haproxy", "texts_per_s": 9.0, "p50_ms": 1.0, "cpu_s_per_1k": 2.0,
             "driver_cpu_s_per_1k": None}]
    report = ingress_ab.build_report(["ingress_ab"], w, runs)
    assert report["requests"] == 40 and "1 per request, 16 in flight" in report["workload"]
    assert report["summary"]["haproxy"]["texts_per_s"] == 9.0


def test_summary_is_the_median_per_mode():
    runs = [{"mode": m, "texts_per_s": t, "p50_ms": 1.0, "cpu_s_per_1k": c,
             "driver_cpu_s_per_1k": d}
            for m, t, c, d in [("haproxy", 90, 20, 3), ("serve_proxy", 60, 33, None),
                               ("haproxy", 100, 21, 4), ("serve_proxy", 50, 30, 2),
                               ("haproxy", 95, 19, 5)]]
    s = ingress_ab.summarize(runs)
    assert s["haproxy"] == {"texts_per_s": 95, "p50_ms": 1.0, "cpu_s_per_1k": 20,
                            "driver_cpu_s_per_1k": 4, "runs": 3}
    # a figure some run could not measure is left out of the median, not counted as 0
    assert s["serve_proxy"] == {"texts_per_s": 55, "p50_ms": 1.0, "cpu_s_per_1k": 31.5,
                                "runs": 2}
