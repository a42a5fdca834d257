"""The prefix-affinity comparison's pure parts (benchmarks/affinity_bench.py): its cluster config,
its workload and its summary. The timed runs themselves belong to `embedfleet bench`."""

from __future__ import annotations

from pathlib import Path

from embedfleet.benchmarks.affinity_bench import (INSTRUCTIONS, KV_BYTES_PER_TOKEN, QUERIES_PER_REQUEST,
                                                  VARIANTS, cluster_config, instructions,
                                                  requests_for, summarize)
from embedfleet.benchmarks.tiny_qwen3 import CONFIG as TINY_QWEN3
from embedfleet.deployments.config.ray_options import AFFINITY_ROUTER_CLASS, engine_deployment_options


def test_the_two_models_differ_only_in_their_router():
    cfg = cluster_config(Path("/models/tiny-qwen3"), 8000)
    opts = {m.name: engine_deployment_options(cfg, m) for m in cfg.models}
    a, d = opts[VARIANTS["affinity"]], opts[VARIANTS["default"]]
    assert a["request_router_config"]["request_router_class"] == AFFINITY_ROUTER_CLASS
    assert "request_router_config" not in d
    assert a["num_replicas"] == d["num_replicas"] == 2
    strip = {"name", "request_router_config"}
    assert {k: v for k, v in a.items() if k not in strip} == \
        {k: v for k, v in d.items() if k not in strip}
    assert cfg.cards == 4


def test_the_kv_pool_holds_about_half_the_instructions_per_card():
    """The model's own shape gives the bytes per token; the pool must hold fewer instructions
    than there are (else the default router would keep all 8 warm everywhere) and at least
    the half a replica owns under affinity."""
    shape = TINY_QWEN3
    per_token = (shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"]
                 * shape["head_dim"] * 4)  # float32
    assert per_token == KV_BYTES_PER_TOKEN
    cfg = cluster_config(Path("/m"), 8000)
    pool_tokens = cfg.models[0].engine.kv_cache_memory_bytes / per_token
    instr_tokens = len(instructions()[0].split())
    assert INSTRUCTIONS / 2 <= pool_tokens / instr_tokens < INSTRUCTIONS * 0.75


def test_requests_share_one_instruction_each_and_differ_in_their_queries():
    reqs = requests_for(40, seed=3)
    instr = instructions()
    assert len(set(instr)) == INSTRUCTIONS and len({i[:256] for i in instr}) == INSTRUCTIONS
    for texts in reqs:
        assert len(texts) == QUERIES_PER_REQUEST
        heads = {next(i for i in instr if t.startswith(i)) for t in texts}
        assert len(heads) == 1
    assert len({t for r in reqs for t in r}) > 0.9 * 40 * QUERIES_PER_REQUEST
    assert requests_for(40, seed=3) == reqs and requests_for(40, seed=4) != reqs


def run(variant, tps, cached, load, rep=0):
    return {"variant": variant, "repeat": rep, "texts_per_s": tps, "p50_ms": 10.0,
            "p99_ms": 20.0, "cached_ratio": cached, "max_load_over_mean": load,
            "cpu_s_per_1k": 5.0}


def test_summary_is_the_median_and_the_goals_follow_the_figures():
    runs = [run("affinity", t, 0.9, 1.1, i) for i, t in enumerate((100, 130, 120))]
    runs += [run("default", t, 0.4, 1.0, i) for i, t in enumerate((80, 90, 85))]
    s = summarize(runs)
    assert s["affinity"]["texts_per_s"] == 120 and s["default"]["texts_per_s"] == 85
    assert s["throughput_ratio"] == round(120 / 85, 3)
    assert s["goals"]["throughput_ratio"]["met"] and s["goals"]["cached_ratio"]["met"]
    assert s["goals"]["max_load_over_mean"]["met"]
    worse = summarize([run("affinity", 100, 0.5, 1.8), run("default", 90, 0.4, 1.0)])
    assert not any(g["met"] for g in worse["goals"].values())
