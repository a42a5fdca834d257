"""The chaos soak's memory verdict (issue 39 item 3): per process tree, growth in the first and
last 10 minutes and the slope over the run's last half; exit 1 past the stated bound.

Traces are built here (no cluster): a warm-up that plateaus, a steady leak, a process a fault
replaced. benchmarks/chaos.py samples real ones from Cluster.memory during a run.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from embedfleet.benchmarks import chaos, chaos_memory
from embedfleet.benchmarks.chaos_memory import (MAX_SLOPE_MB_PER_H, memory_slopes,
                                                memory_verdict, slope_per_h)


def trace(wall_s: float, every_s: float, procs: dict[int, tuple[str, object]], own=None):
    """Samples every ``every_s`` over ``wall_s``; ``procs``: pid -> (role, f(t) -> tree MB or
    None when the process is not alive at t); ``own(t)``: the process's own MB (default 1)."""
    out, t = [], 0.0
    while t <= wall_s:
        recs = [{"pid": pid, "role": role, "rss_mb": own(t) if own else 1.0, "tree_rss_mb": mb}
                for pid, (role, f) in procs.items() if (mb := f(t)) is not None]
        out.append((t, recs))
        t += every_s
    return out


def warm_up(t: float) -> float:  # +300 MB over the first 15 minutes, then flat
    return 1000.0 + 300.0 * min(t, 900.0) / 900.0


def leak(t: float) -> float:  # 30 MB an hour, all the way
    return 500.0 + 30.0 * t / 3600.0


def test_the_slope_is_least_squares_in_mb_per_hour():
    assert slope_per_h([(0.0, 100.0), (1800.0, 110.0), (3600.0, 120.0)]) == pytest.approx(20.0)
    assert slope_per_h([(0.0, 5.0), (60.0, 5.0)]) == 0.0
    assert slope_per_h([(7.0, 5.0)]) == 0.0  # one point: no slope to speak of


def test_a_warm_up_that_plateaus_is_flat_and_its_first_ten_minutes_show_the_growth():
    s = memory_slopes(trace(3600, 60, {11: ("engine-minilm", warm_up)}), 3600, 60)
    e = s["engine-minilm:11"]
    assert e["first_window_mb"] == pytest.approx(200.0, abs=1)  # 600 of the 900 s ramp
    assert e["last_window_mb"] == 0.0 and e["slope_mb_per_h"] == 0.0
    assert memory_verdict(s, MAX_SLOPE_MB_PER_H)["flat"] is True


def test_a_steady_leak_is_over_the_bound_and_named():
    s = memory_slopes(trace(3600, 60, {11: ("engine-minilm", warm_up), 12: ("Router", leak)}),
                      3600, 60)
    assert s["Router:12"]["slope_mb_per_h"] == pytest.approx(30.0, abs=0.1)
    assert s["Router:12"]["last_window_mb"] == pytest.approx(5.0, abs=0.1)
    v = memory_verdict(s, MAX_SLOPE_MB_PER_H)
    assert v["flat"] is False and v["over_bound"] == ["Router:12"] and v["measured"] == 2


def test_the_slope_is_split_between_the_process_and_its_children():
    # the replica itself leaks 30 MB/h (its tree too); its engine core (the rest) is flat
    s = memory_slopes(trace(3600, 60, {11: ("engine-minilm", lambda t: 1000.0 + leak(t))},
                            own=leak), 3600, 60)["engine-minilm:11"]
    assert s["slope_mb_per_h"] == pytest.approx(30.0, abs=0.1)
    assert s["own_slope_mb_per_h"] == pytest.approx(30.0, abs=0.1)
    assert s["children_slope_mb_per_h"] == pytest.approx(0.0, abs=0.1)
    lines = chaos_memory.memory_lines({"engine-minilm:11": s}, memory_verdict(
        {"engine-minilm:11": s}, MAX_SLOPE_MB_PER_H))
    assert "+30.0 = +30.0 +0.0" in lines[1], lines


def test_a_process_replaced_in_the_last_half_has_no_slope_and_alone_is_inconclusive():
    procs = {21: ("engine-minilm", lambda t: leak(t) if t < 2400 else None),
             22: ("engine-minilm", lambda t: leak(t) if t >= 2400 else None)}
    s = memory_slopes(trace(3600, 60, procs), 3600, 60)
    assert s["engine-minilm:21"]["slope_mb_per_h"] is None  # gone before the end
    assert s["engine-minilm:22"]["slope_mb_per_h"] is None  # came after the half began
    v = memory_verdict(s, MAX_SLOPE_MB_PER_H)
    assert v["flat"] is None
    assert "inconclusive" in "\n".join(chaos_memory.memory_lines(s, v))


def test_a_short_run_measures_no_slope():
    s = memory_slopes(trace(60, 30, {1: ("Router", leak)}), 60, 30)
    assert s["Router:1"]["slope_mb_per_h"] is None  # 2 samples in the last half


def test_faults_stop_at_faults_until_and_the_quiet_tail_is_left_alone():
    plan = chaos.fault_schedule(3600, 60, chaos.FAULT_KINDS, until_s=660)
    assert [t for t, _ in plan] == [60.0 * i for i in range(1, 11)]
    assert [k for _, k in plan] == list(chaos.FAULT_KINDS)
    assert chaos.fault_schedule(3600, 60, ["kill-replica"], until_s=None)[-1][0] == 3540.0


def test_the_sampler_takes_one_at_once_then_one_a_period_until_stopped():
    calls = []

    async def sample():
        calls.append(time.monotonic())
        return [{"pid": 1, "role": "Router", "rss_mb": 1.0, "tree_rss_mb": 2.0}]

    async def go():
        got, stop = [], asyncio.Event()
        task = asyncio.create_task(chaos_memory.sample_memory(sample, time.monotonic(), 0.05,
                                                              got, stop))
        await asyncio.sleep(0.22)
        stop.set()
        await task
        return got

    got = asyncio.run(go())
    assert 4 <= len(got) <= 6 and got[0][0] < 0.05
    assert [t for t, _ in got] == sorted(t for t, _ in got)


def test_the_report_carries_the_slopes_and_main_exits_1_on_a_leak(monkeypatch, tmp_path, capsys):
    t = trace(3600, 60, {12: ("Router", leak), 11: ("engine-minilm", warm_up)})
    report = chaos.build_report({"memory_every": 60}, chaos.Tally(), 3600.0, [], t[0][1],
                                t[-1][1], trace=t)
    assert report["summary"]["memory_flat"] is False
    assert report["summary"]["memory_slope_mb_per_h_by_process"]["Router:12"] == 30.0
    assert "NOT flat: Router:12" in chaos.summary(report)

    async def fake_run(opts):
        return report

    monkeypatch.setattr(chaos, "run", fake_run)
    assert chaos.main(["--duration", "3600", "--out", str(tmp_path / "r.json")]) == 1
    assert "FAIL: memory grows past 10.0 MB/h" in capsys.readouterr().out
    flat = trace(3600, 60, {11: ("engine-minilm", warm_up)})
    report = chaos.build_report({"memory_every": 60}, chaos.Tally(), 3600.0, [], flat[0][1],
                                flat[-1][1], trace=flat)
    assert chaos.main(["--duration", "3600", "--out", str(tmp_path / "r.json")]) == 0


@pytest.mark.parametrize("argv", [["--memory-every", "0"], ["--faults-until", "0"],
                                  ["--max-slope", "0"], ["--memory-every", "601"]])
def test_memory_options_out_of_bounds_are_refused(argv):
    with pytest.raises(SystemExit) as exc:
        chaos.main(["--duration", "1", *argv])
    assert exc.value.code == 2
