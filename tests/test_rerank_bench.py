"""`embedfleet bench`'s rerank workload, without a cluster: its requests fit both servers' request
models (embedfleet's and vLLM's own pydantic classes), the templated body makes vLLM score the
very text embedfleet renders, answers are read in document order, the goal is judged on pairs,
and CPU per 1,000 pairs comes from the measured CPU."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from embedfleet.benchmarks import rerank_bench as rb
from embedfleet.benchmarks import report as rpt
from embedfleet.benchmarks import report_text
from embedfleet.benchmarks.bench import DEFAULT_WORKLOADS, parse_args
from embedfleet.benchmarks.server_peers import serve_flags
from embedfleet.benchmarks.tiny_qwen3_reranker import build_tiny_qwen3_reranker
from embedfleet.deployments.config.schema import load_config
from embedfleet.deployments.engine.rerank_models import FAMILIES, QWEN3_RERANKER_OVERRIDES
from embedfleet.deployments.ingress.rerank import RerankApiRequest

TEMPLATE = FAMILIES[0].template


@pytest.fixture(scope="module")
def folder():
    return build_tiny_qwen3_reranker()


def test_workload_is_a_query_and_32_documents_a_request_and_seeded():
    w = rb.build_rerank(6, seed=3, warmup=2)
    assert w == rb.build_rerank(6, seed=3, warmup=2)
    assert w.requests != rb.build_rerank(6, seed=4, warmup=2).requests
    assert len(w.requests) == 6 and all(len(d) == 32 for _, d in w.requests)
    assert w.pairs == 6 * 32 and len(w.warmup) == 2
    measured = {d for _, docs in w.requests for d in docs}
    assert not measured & {d for _, docs in w.warmup for d in docs}  # warm-up caches nothing timed


@pytest.mark.parametrize("template", [TEMPLATE, None], ids=["rendered", "raw"])
def test_bodies_fit_embedfleet_and_vllm_request_models(template):
    from vllm.entrypoints.pooling.scoring.protocol import RerankRequest

    query, docs = rb.build_rerank(1, warmup=1).requests[0]
    body = rb.rerank_body("tiny-qwen3-reranker", query, docs, template)
    ours = RerankApiRequest.model_validate(body)  # extra="forbid": a stray field would fail
    theirs = RerankRequest.model_validate(body)
    assert set(body) <= set(RerankRequest.model_fields)  # vLLM reads every field sent
    assert len(ours.documents) == len(theirs.documents) == 32
    if template is None:
        assert body["query"] == query and body["documents"] == docs


def test_rendered_body_is_what_embedfleet_scores():
    """vLLM scores query + document as one text (a reranker without a sep token): with the
    rendered body that text is exactly embedfleet's ``ScoreTemplate.render`` of the raw pair."""
    query, docs = rb.build_rerank(1, warmup=1).requests[0]
    body = rb.rerank_body("m", query, docs, TEMPLATE)
    assert [body["query"] + d for d in body["documents"]] == [TEMPLATE.render(query, d)
                                                              for d in docs]
    assert body["query"] != query  # rendered, not raw


def test_vllm_answer_is_read_in_document_order():
    from vllm.entrypoints.pooling.scoring.protocol import (
        RerankDocument,
        RerankResponse,
        RerankResult,
        RerankUsage,
    )

    scores = [0.2, 0.9, 0.5]
    best_first = sorted(range(3), key=lambda i: -scores[i])
    resp = RerankResponse(id="r", model="m", usage=RerankUsage(prompt_tokens=1, total_tokens=1),
                          results=[RerankResult(index=i, relevance_score=scores[i],
                                                document=RerankDocument(text=str(i)))
                                   for i in best_first]).model_dump()
    assert rb.scores_in_order(resp, 3) == scores
    with pytest.raises(ValueError, match="asked to rank 4"):
        rb.scores_in_order(resp, 4)


def test_config_and_vllm_serve_flags_carry_the_qwen3_overrides(folder):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cfg = rb.rerank_config(load_config(None), folder, "http://127.0.0.1:8000")
    (m,) = cfg.models
    assert m.task == "rerank" and cfg.cards == 1 and m.replicas.max_replicas == 1
    kw = cfg.engine_kwargs(m, enable_prefix_caching=True)
    assert kw["hf_overrides"] == QWEN3_RERANKER_OVERRIDES
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    back = AsyncEngineArgs.from_cli_args(parser.parse_args(serve_flags(kw)))
    assert back.hf_overrides == QWEN3_RERANKER_OVERRIDES and back.runner == "pooling"
    assert back.max_model_len == rb.MAX_MODEL_LEN


def test_pair_tokens_count_the_rendered_pairs(folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    reqs = rb.build_rerank(1, warmup=1).requests
    n = rb.pair_tokens(tok, TEMPLATE, reqs)
    q, docs = reqs[0]
    assert len(n) == 32 and n[0] == len(tok(TEMPLATE.render(q, docs[0]))["input_ids"])
    assert max(n) <= rb.MAX_MODEL_LEN


def _rerank_runs(ef_s, serve_s, pairs=1536, repeats=5, cpu=(3.072, 6.144)):
    from tests.test_bench_unit import _cpu

    runs = []
    for i in range(repeats):
        runs.append(rpt.run_record(repeat=i, workload="rerank", peer="embedfleet",
                                   latencies=[0.1] * 48, seconds=ef_s, texts=pairs, tokens=1,
                                   cpu=_cpu(cpu[0], driver_s=0.5)))
        runs.append(rpt.run_record(repeat=i, workload="rerank", peer="vllm-serve",
                                   latencies=[0.1] * 48, seconds=serve_s, texts=pairs, tokens=1,
                                   cpu=_cpu(cpu[1], driver_s=0.5)))
    return runs


def _info(per_request=rb.DOCS_PER_REQUEST):
    return {"rerank": {"texts_per_request": per_request, "concurrency": 4}}


def _goal(runs, info):
    return next(g for g in rpt.evaluate_goals(rpt.summarize(runs), info)
                if g["workload"] == "rerank")


def test_goal_is_pairs_per_second_against_vllm_serve():
    g = _goal(_rerank_runs(ef_s=8.0, serve_s=10.0), _info())
    assert (g["reference"], g["target"], g["op"]) == ("vllm-serve", 1.1, ">=")
    assert g["value"] == round((1536 / 8) / (1536 / 10), 3) and g["status"] == "met"
    assert _goal(_rerank_runs(ef_s=9.5, serve_s=10.0), _info())["status"] == "not met"
    assert _goal(_rerank_runs(8.0, 10.0, repeats=4), _info())["status"] == "needs >= 5 repeats"
    assert _goal(_rerank_runs(8.0, 10.0), _info(16))["status"] == "not measured"


def test_cpu_per_1000_pairs_is_the_measured_cpu_over_pairs():
    s = rb.pair_summary(rpt.summarize(_rerank_runs(8.0, 10.0))["rerank"])
    assert s["embedfleet"]["cpu_s_per_1k_pairs"] == 2.0  # 3.072 CPU-s / 1,536 pairs * 1,000
    assert s["vllm-serve"]["cpu_s_per_1k_pairs"] == 4.0
    assert s["embedfleet"]["pairs_per_s"] == 192.0 and s["embedfleet"]["repeats"] == 5
    assert s["embedfleet"]["driver_cpu_s_per_1k_pairs"] == round(1000 * 0.5 / 1536, 4)


class _BurningPeer:
    """Stand-in peer: scores each document by burning CPU in this process."""

    name = "vllm"

    async def rerank(self, query, docs):
        t = time.process_time()
        while time.process_time() - t < 0.002 * len(docs):
            pass
        return [0.5] * len(docs)


def test_timed_run_reports_the_metered_cpu_per_1000_pairs():
    from embedfleet.benchmarks.process_cpu import CpuMeter, OwnProcess

    w = rb.build_rerank(3, warmup=1)
    meter = CpuMeter({"peer": OwnProcess(os.getpid(), "this process")})
    r = asyncio.run(rb._timed(_BurningPeer(), w, 0, 1000, 2, meter))
    assert r["error"] is None and r["texts"] == 96 and r["requests"] == 3
    assert r["cpu_s"] >= 0.15  # 96 pairs * 2 ms burnt, measured
    assert r["cpu_s_per_1k"] == round(1000 * r["cpu_s"] / 96, 4)

    class Broken:
        def start(self):
            raise OSError("no /proc")

    r = asyncio.run(rb._timed(_BurningPeer(), w, 0, 1000, 2, Broken()))
    assert r["error"] is None and r["cpu_s_per_1k"] is None and "no /proc" in r["cpu_error"]


def test_scores_agree_within_the_issue_bound():
    c = rb.score_agreement({"vllm": [0.5, 0.25], "vllm-serve": [0.5004, 0.25],
                            "embedfleet": [0.5, 0.27], "x": "probe request failed: 500"},
                           "vllm")
    assert c["vllm"]["ok"] is True and c["vllm-serve"]["ok"] is True
    assert c["embedfleet"]["ok"] is False and c["embedfleet"]["max_abs_delta"] == 0.02
    assert c["x"]["ok"] is False


def test_rerank_is_asked_for_by_name_and_takes_a_model_path(tmp_path):
    assert "rerank" not in DEFAULT_WORKLOADS
    a = parse_args(["--workloads", "rerank", "--rerank-model", str(tmp_path)])
    assert a.workload_list == ["rerank"] and a.rerank_model == tmp_path


def _section(status="ok", ok=True, peer_status="ok"):
    runs = _rerank_runs(8.0, 10.0)
    return runs, {"status": status, "reason": None if status == "ok" else "boom",
                  "model": "tiny-qwen3-reranker", "peers": {"embedfleet": {"status": peer_status}},
                  "correctness": {"reference": "vllm", "max_abs_delta": 1e-3,
                                  "peers": {"embedfleet": {"max_abs_delta": 0.0, "ok": ok}}},
                  "summary": rb.pair_summary(rpt.summarize(runs)["rerank"])}


@pytest.mark.parametrize("kw,ok", [({}, True), ({"ok": False}, False),
                                   ({"status": "failed"}, False),
                                   ({"peer_status": "failed"}, False)])
def test_report_carries_the_rerank_section_and_its_problems(kw, ok):
    runs, section = _section(**kw)
    report = rpt.build_report(
        command=["bench"], started_at="t0", finished_at="t1", machine={}, settings={},
        workloads=_info(), peers={"embedfleet": {"status": "ok"},
                                  "vllm-serve": {"status": "ok"}},
        runs=runs, skipped=[], probes={}, prefix_cache=None, rerank=section)
    assert rpt.check_schema(report) == [] and report["ok"] is ok
    assert report["problems"]["rerank_failed_or_disagrees"] is (not ok)
    text = "\n".join(report_text.closing_lines(report))
    if kw.get("status") == "failed":
        assert "rerank: failed: boom" in text
    else:
        assert "embedfleet 192.0 pairs/s, CPU 2.000 s per 1k pairs" in text
    assert "rerank, query + 32 documents/request: embedfleet / vllm serve, pairs/s: 1.25" in text


def test_peers_send_their_own_body_shape():
    serve = rb.ServeReranker(TEMPLATE, {"model": "/m", "served_model_name": "r",
                                        "hf_overrides": QWEN3_RERANKER_OVERRIDES}, 4,
                             Path("/tmp"), None)
    assert serve.template is TEMPLATE and serve.name == "vllm-serve"
    assert '"is_original_qwen3_reranker": true' in " ".join(serve.server.cmd)
    ef = rb.EmbedfleetReranker("http://127.0.0.1:8000", "r", 4,
                               SimpleNamespace(), Path("/tmp"), None)
    assert ef.template is None  # embedfleet renders the template itself


def test_tiny_reranker_tokenizer_returns_what_qwen3s_does(folder):
    """No token_type_ids (the borrowed BERT tokenizer's): vLLM's server would pass them to
    Qwen3ForCausalLM.forward, which refuses them and the engine core dies."""
    from transformers import AutoTokenizer

    enc = AutoTokenizer.from_pretrained(folder)("query", "document")
    assert set(enc) == {"input_ids", "attention_mask"}
    assert build_tiny_qwen3_reranker() == folder  # reused as is, not rebuilt to another place


def test_a_running_cluster_without_the_reranker_is_named_with_the_fix(tmp_path):
    ef = rb.EmbedfleetReranker("http://127.0.0.1:1", "tiny-qwen3-reranker", 4, SimpleNamespace(),
                               tmp_path, None)

    async def models():
        return {"data": [{"id": "all-minilm-l6-v2"}]}

    ef._models = models
    with pytest.raises(RuntimeError, match=r"does not serve the reranker .*embedfleet down"):
        asyncio.run(ef.start())
    assert ef.started_cluster is False  # never starts or stops someone else's cluster


def test_the_built_reranker_gets_a_canary_triple_its_reference_orders(folder):
    """The shipped triple needs trained weights (a random-weight model orders it by chance: a
    bench run's replica failed its canary 0.4709 <= 0.4904 and never served); the bench fixes the
    built model's triple from transformers' scores, as the e2e tests do."""
    from transformers import AutoTokenizer

    from embedfleet.benchmarks.tiny_qwen3_reranker import canary_triple, reference_scores
    from embedfleet.deployments.engine.rerank_models import family_for

    fam = family_for([folder.name.lower(), str(folder)])
    triple = canary_triple(folder, fam.template)
    tok = AutoTokenizer.from_pretrained(folder)
    ids = [list(x) for x in tok([fam.template.render(triple["query"], triple[k])
                                 for k in ("relevant", "irrelevant")])["input_ids"]]
    relevant, irrelevant = reference_scores(folder, ids)
    assert triple["relevant"] != triple["irrelevant"] and relevant > irrelevant
    (m,) = rb.rerank_config(load_config(None), folder, "http://127.0.0.1:8000", triple).models
    assert m.rerank.canary.model_dump() == triple
    (plain,) = rb.rerank_config(load_config(None), folder, "http://127.0.0.1:8000").models
    assert plain.rerank.canary is None
