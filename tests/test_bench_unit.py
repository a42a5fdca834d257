"""`embedfleet bench`'s pure parts: workloads, summary math, report schema, chart, chunking, the
vllm-serve flags and the embedfleet peer's requests - plus one --quick smoke run of the peers
that need no cluster (vllm, vllm-serve, infinity when its venv exists)."""

from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from embedfleet.benchmarks import report as rpt
from embedfleet.benchmarks import workloads as wl
from embedfleet.benchmarks.bench import parse_args, parse_cores
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
    serve_flags,
)
from embedfleet.benchmarks.prefix_cache_bench import engine_deltas, summarize_variants
from embedfleet.deployments.config import load_config

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
    path = rpt.write_chart(_report(prefix_cache=pc), tmp_path / "chart.png")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    table = rpt.summary_table(_report())
    assert table.row_count == 2 * 4  # every workload x every peer, skipped ones included


# -- chunking: the vllm peer's windows are embedfleet's ------------------------------------------
def test_prechunk_matches_embedfleet_long_input(cfg, minilm_tokenizer):
    from embedfleet.deployments.request_path.long_input import SpecialTokens, plan

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
    from embedfleet.deployments.api.openai import embedding_response, parse_embedding_request

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
    assert parse_args([]).repeats == 3
    for bad in (["--peers", "tei"], ["--workloads", "huge"], ["--batch", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_cli_forwards_bench_args():
    from embedfleet.cluster.cli import build_parser

    args = build_parser().parse_args(["bench", "--quick", "--peers", "vllm"])
    assert args.command == "bench" and args.bench_args == ["--quick", "--peers", "vllm"]

