"""The replica's rerank path (replica/rerank_path.py) over a real RequestPath's runs and a real
AdmissionBudget, with a STAND-IN engine (a score per pair from its token ids) and the tiny
reranker's real tokenizer: pairs rendered with the family's template, scores in document order,
the same budget and lanes as embeddings, the context and token bounds, the role checks and the
ordering canary that keeps a wrong reranker from serving."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from embedfleet.deployments.common.errors import (InputTooLong, InvalidParameterValue,
                                                  RequestTooLarge)
from embedfleet.deployments.common.rerank_calls import RerankCall
from embedfleet.deployments.config.schema import parse_config
from embedfleet.deployments.engine.vllm_engine import Embedding
from embedfleet.deployments.replica.admission import AdmissionBudget
from embedfleet.deployments.replica.canary import RerankCanaryFailed
from embedfleet.deployments.replica.rerank_path import RerankPath
from tests.support.request_path_standins import request_path_over
from tests.support.tiny_qwen3_reranker import build_tiny_qwen3_reranker

MAX_LEN = 160


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny_qwen3_reranker())


class StandinScorer:
    """STAND-IN engine: a pair's score is its token count / 1000; remembers what it got."""

    def __init__(self, tokenizer, flip: bool = False) -> None:
        self.info = SimpleNamespace(prefix_caching=False)
        self.seen: list[list[int]] = []
        self.calls: list[dict] = []
        self.tok = tokenizer
        self.flip = flip

    async def embed(self, ids, **kw):
        self.seen += ids
        self.calls.append(kw)
        sign = -1 if self.flip else 1
        return [Embedding(np.array([sign * len(x) / 1000], np.float32), len(x)) for x in ids]


def _path(tokenizer, engine, *, task="rerank", pooling="classify", max_tokens=1 << 30,
          large=1 << 30, canary=None):
    m = parse_config({"models": [{"name": "rr", "task": task, "source": {
        "path": "/m/tiny-qwen3-reranker" if task == "rerank" else "/m/e"},
        "rerank": {"canary": canary} if canary else {}}]}).models[0]
    budget = AdmissionBudget(64, 1 << 20)
    path = request_path_over(lambda: engine, budget, [], max_tokens=max_tokens,
                             large_call_tokens=large)
    path.__dict__.update(
        info=SimpleNamespace(max_model_len=MAX_LEN, pooling_task=pooling),
        hf_tokenizer=tokenizer,
        _gate=SimpleNamespace(use=path._gate.use, engine=engine),
        preparer=SimpleNamespace(tokenizer=lambda texts: [
            list(x) for x in tokenizer(texts, add_special_tokens=True)["input_ids"]]))
    return RerankPath(path, m), budget


def test_scores_in_document_order_from_rendered_pairs(tokenizer):
    eng = StandinScorer(tokenizer)
    rr, _ = _path(tokenizer, eng)
    docs = ["short", "a much longer document about many things", "mid size doc"]
    res = asyncio.run(rr.rerank(RerankCall("what?", docs, "r1", "rr")))
    assert res.scores == pytest.approx([len(s) / 1000 for s in eng.seen])
    assert res.scores[1] > res.scores[2] > res.scores[0]
    assert res.prompt_tokens == sum(len(s) for s in eng.seen)
    text = tokenizer.decode(eng.seen[0])
    assert "judge whether the document meets the requirements" in text  # the template (lowered)
    assert "< query > : what?" in text and "< document > : short" in text
    assert eng.calls[0]["normalize"] is True and eng.calls[0]["priority"] == 0


def test_raw_scores_and_bulk_lane_reach_the_engine(tokenizer):
    eng = StandinScorer(tokenizer)
    rr, _ = _path(tokenizer, eng, large=10)  # any call is "large": scheduled as bulk
    asyncio.run(rr.rerank(RerankCall("q", ["d1", "d2"], "r", "rr", raw_scores=True)))
    assert all(c["normalize"] is False for c in eng.calls)
    assert all(c["priority"] == 1 for c in eng.calls)  # bulk's vLLM priority


def test_bounds(tokenizer):
    eng = StandinScorer(tokenizer)
    rr, _ = _path(tokenizer, eng, max_tokens=100)
    with pytest.raises(RequestTooLarge, match="limits.max_tokens of 100"):
        asyncio.run(rr.rerank(RerankCall("q", ["d"] * 3, "r", "rr")))
    rr, _ = _path(tokenizer, eng)
    long_doc = "word " * 400
    with pytest.raises(InputTooLong, match="truncate: true"):
        asyncio.run(rr.rerank(RerankCall("q", ["ok", long_doc], "r", "rr")))
    assert eng.seen == []  # refused before any work
    res = asyncio.run(rr.rerank(RerankCall("q", ["ok", long_doc], "r", "rr", truncate=True)))
    assert len(res.scores) == 2 and all(len(s) <= MAX_LEN for s in eng.seen)
    assert "< query > : q" in tokenizer.decode(eng.seen[1])  # the query and template kept
    assert tokenizer.decode(eng.seen[1]).endswith("< think > < / think > [SEP]")  # suffix kept


def test_an_embedder_does_not_rerank(tokenizer):
    rr, _ = _path(tokenizer, StandinScorer(tokenizer), task="embed", pooling="embed")
    asyncio.run(rr.start())  # nothing to prove for an embedder
    with pytest.raises(InvalidParameterValue, match="is an embedding model"):
        asyncio.run(rr.rerank(RerankCall("q", ["d"], "r", "rr")))


def test_start_refuses_an_engine_that_embeds(tokenizer):
    rr, _ = _path(tokenizer, StandinScorer(tokenizer), pooling="embed")
    with pytest.raises(RuntimeError, match="runs it as an embedding model"):
        asyncio.run(rr.start())


TRIPLE = {"query": "q", "relevant": "a long relevant document with many words",
          "irrelevant": "short"}


def test_ordering_canary_passes_and_fails(tokenizer):
    rr, _ = _path(tokenizer, StandinScorer(tokenizer), canary=TRIPLE)
    asyncio.run(rr.start())
    assert rr.last_canary.passed and rr.last_canary.relevant > rr.last_canary.irrelevant
    rr, _ = _path(tokenizer, StandinScorer(tokenizer, flip=True), canary=TRIPLE)
    with pytest.raises(RerankCanaryFailed, match="orders it wrong"):
        asyncio.run(rr.start())
    assert not rr.last_canary.passed
