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
          large=1 << 30, canary=None, budget_tokens=1 << 20):
    m = parse_config({"models": [{"name": "rr", "task": task, "source": {
        "path": "/m/tiny-qwen3-reranker" if task == "rerank" else "/m/e"},
        "rerank": {"canary": canary} if canary else {}}]}).models[0]
    budget = AdmissionBudget(64, budget_tokens)
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


class HeldScorer(StandinScorer):
    """STAND-IN engine that holds every call until released, and records the tokens it holds."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.release = asyncio.Event()
        self.held = self.most_held = 0

    async def embed(self, ids, **kw):
        n = sum(map(len, ids))
        self.held += n
        self.most_held = max(self.most_held, self.held)
        try:
            await self.release.wait()
        finally:
            self.held -= n
        return await super().embed(ids, **kw)


def test_a_call_is_admitted_in_parts_that_fill_the_budget_and_stay_within_it(tokenizer):
    """Two calls of ~60% of the token budget each: admitted whole, the second would wait until
    the first is done (the engine's steps 60% full); in parts of an eighth of the budget, the
    second's parts go in beside the first, up to the budget and never past it. Scores stay in
    document order."""
    eng = HeldScorer(tokenizer)
    docs = [f"document number {i} " + "word " * (i % 5) for i in range(24)]
    probe, _ = _path(tokenizer, StandinScorer(tokenizer))
    ids, _ = probe.pair_ids("q", docs, truncate=False)
    call_tokens = sum(map(len, ids))
    budget_tokens = int(call_tokens / 0.6)
    rr, budget = _path(tokenizer, eng, budget_tokens=budget_tokens)

    async def run():
        calls = [asyncio.ensure_future(rr.rerank(RerankCall("q", docs, f"r{k}", "rr")))
                 for k in range(2)]
        for _ in range(50):
            await asyncio.sleep(0)
        held, waiting = eng.most_held, budget.snapshot()["waiting"]
        eng.release.set()
        return held, waiting, await asyncio.gather(*calls)

    held, waiting, results = asyncio.run(run())
    assert call_tokens < held <= budget_tokens, (call_tokens, held, budget_tokens)
    assert waiting <= 2  # each call's next part: a call queues one part at a time
    assert len(eng.calls) > 2  # in parts: more engine calls than requests
    want = [len(x) / 1000 for x in ids]
    assert all(r.scores == pytest.approx(want) for r in results)
    assert budget.snapshot()["inflight_tokens"] == 0


def test_a_call_refused_while_its_parts_wait_leaves_nothing_queued_or_held(tokenizer):
    """The first part of the second call is refused (429: the queue is full): none of its
    other parts queues (they follow only an admitted part), nothing stays held, and the first
    call is answered."""
    from embedfleet.deployments.common.errors import Overloaded

    eng = HeldScorer(tokenizer)
    docs = [f"document {i}" for i in range(16)]
    probe, _ = _path(tokenizer, StandinScorer(tokenizer))
    ids, _ = probe.pair_ids("q", docs, truncate=False)
    # the first call fits whole, and no part of the second fits beside it
    rr, budget = _path(tokenizer, eng, budget_tokens=sum(map(len, ids)) + min(map(len, ids)) - 1)
    budget._max_waiting = 0  # a new call that does not fit at once is refused

    async def run():
        first = asyncio.ensure_future(rr.rerank(RerankCall("q", docs, "r0", "rr")))
        for _ in range(1000):  # until the whole first call is in the engine
            if eng.held == sum(map(len, ids)):
                break
            await asyncio.sleep(0)
        with pytest.raises(Overloaded):
            await rr.rerank(RerankCall("q", docs, "r1", "rr"))
        snap = budget.snapshot()
        eng.release.set()
        return snap, await first

    snap, res = asyncio.run(run())
    assert len(res.scores) == len(docs)
    assert snap["waiting"] == 0 and snap["waiting_tokens"] == 0
    assert budget.snapshot()["inflight_tokens"] == 0 and eng.held == 0


def test_a_part_refused_after_others_ran_cancels_them_and_hands_their_budget_back(tokenizer):
    """Half the call's parts fill the budget and hold it in the engine; the next part times out
    in the queue (429). The call fails as a whole: its parts in the engine are cancelled, and
    their budget is handed back at once."""
    from embedfleet.deployments.common.errors import Overloaded

    eng = HeldScorer(tokenizer)
    docs = [f"document {i}" for i in range(16)]
    probe, _ = _path(tokenizer, StandinScorer(tokenizer))
    ids, _ = probe.pair_ids("q", docs, truncate=False)
    rr, budget = _path(tokenizer, eng, budget_tokens=sum(map(len, ids)) // 2)
    budget._queue_timeout_s = 0.05

    async def run():
        with pytest.raises(Overloaded):
            await rr.rerank(RerankCall("q", docs, "r0", "rr"))
        return budget.snapshot(), eng.held

    snap, held = asyncio.run(run())
    assert snap["inflight_tokens"] == 0 and snap["waiting"] == 0 and held == 0
    assert sum(snap["rejected"].values()) == 1  # one request refused, counted once
