"""The lanes bench's arithmetic (benchmarks/lanes_bench.py): medians over repeats, the ratios of
each repeat's mixed phase to its solo phases, and goals that fail when the figures do."""

from __future__ import annotations

from embedfleet.benchmarks.lanes_bench import PhaseResult, summarize


def _rep(idle_ms: list[float], mixed_ms: list[float], solo_texts: int, mixed_texts: int,
         refused: int = 0) -> list[PhaseResult]:
    return [PhaseResult("idle", 10, interactive_ms=idle_ms),
            PhaseResult("bulk", 10, bulk_texts=solo_texts),
            PhaseResult("mixed", 10, interactive_ms=mixed_ms, bulk_texts=mixed_texts,
                        interactive_refused=refused)]


def test_ratios_are_per_repeat_then_the_median():
    runs = [_rep([10.0] * 100, [15.0] * 100, 1000, 600),
            _rep([20.0] * 100, [30.0] * 100, 2000, 1400),
            _rep([10.0] * 100, [50.0] * 100, 1000, 100)]
    s = summarize(runs)
    assert s["ratios"]["interactive_p99_mixed_over_idle"] == 1.5   # 1.5, 1.5, 5.0
    assert s["ratios"]["bulk_texts_per_s_mixed_over_solo"] == 0.6  # 0.6, 0.7, 0.1
    assert s["goals"]["met"] == {"interactive_p99": True, "bulk_throughput": True,
                                 "no_interactive_refusal": True}
    assert s["bulk"]["bulk_texts_per_s"] == 100.0 and s["idle"]["interactive_p99_ms"] == 10.0


def test_goals_fail_when_the_figures_do():
    s = summarize([_rep([10.0] * 100, [25.0] * 100, 1000, 400, refused=1)])
    assert s["goals"]["met"] == {"interactive_p99": False, "bulk_throughput": False,
                                 "no_interactive_refusal": False}


def test_the_p99_is_the_slow_tail_not_the_mean():
    r = PhaseResult("idle", 10, interactive_ms=[1.0] * 98 + [100.0, 200.0])
    assert r.percentile(0.99) == 200.0 and r.percentile(0.5) == 1.0
    assert PhaseResult("idle", 10).percentile(0.99) is None


def test_embedfleet_bench_runs_lanes_on_two_replicas_of_the_shipped_model():
    from embedfleet.benchmarks.bench import DEFAULT_WORKLOADS, parse_args
    from embedfleet.benchmarks.embedfleet_peer import bench_config
    from embedfleet.deployments.config.schema import load_config

    base = load_config(None)
    cfg = bench_config(base, "http://127.0.0.1:8123", replicas=2)  # what run_lanes starts
    (m,) = cfg.models
    assert m.name == base.models[0].name and cfg.cards == 2 and cfg.router.port == 8123
    assert m.replicas.min_replicas == m.replicas.max_replicas == 2
    assert "lanes" not in DEFAULT_WORKLOADS  # it starts a cluster: asked for by name
    assert parse_args(["--workloads", "lanes", "--peers", "vllm"]).workload_list == ["lanes"]


def test_the_bench_prints_the_lanes_figures_and_goals():
    from embedfleet.benchmarks.report_text import lanes_lines

    s = summarize([_rep([10.0] * 100, [25.0] * 100, 1000, 400)])
    (line,) = lanes_lines({"status": "ok", "options": {"repeats": 1}, "summary": s})
    assert "x2.50 (goal <= 2: NOT met)" in line and "0.40 (goal >= 0.5: NOT met)" in line
    assert lanes_lines({"status": "failed", "reason": "no cluster"}) == [
        "lanes: failed: no cluster"]
