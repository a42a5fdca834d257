"""A reranker replica's request path: (query, document) pairs in, one score a pair out.

A pair is rendered into the one text the model scores (its family's template from
``engine/rerank_models.py``, instruction first, so a request's pairs share their prefix in the
cache), tokenised by the engine's own tokenizer, bounded, and then goes through the embedding
path's own machinery (``RequestPath._runs``): the same owner queue and budget, the same lanes
(a large call scheduled as bulk), the same engine gate, swap resends and failure handling. The
engine runs the classify pooling task (``engine/vllm_api.py``), so each "vector" is the pair's
score.

Before the replica serves, the ordering canary (``replica/canary.run_rerank_canary``) scores a
known triple; a reranker that orders it wrong is refused (``RerankCanaryFailed``): marked down,
never serving silently wrong scores.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..common.contracts import EmbedCall, Lane
from ..common.errors import InputTooLong, InvalidParameterValue, RequestTooLarge
from ..common.rerank_calls import RerankCall, RerankResult
from ..config.schema import ModelConfig
from ..engine.rerank_models import RerankFamily, family_for
from .canary import DEFAULT_TRIPLE, RerankCanaryFailed, RerankCanaryResult, run_rerank_canary
from .request_path import THREAD_TOKENIZE_CHARS, RequestPath

logger = logging.getLogger("embedfleet.rerank")

# Times a too-long pair's document is cut and the pair re-tokenised before giving up (a cut at
# a token boundary can re-tokenise a token or two longer).
TRUNCATE_PASSES = 3


class RerankPath:
    def __init__(self, path: RequestPath, m: ModelConfig) -> None:
        self._path = path
        self._m = m
        self.family: RerankFamily | None = family_for(
            [m.name, *(v for v in m.source.model_dump().values() if v)])
        self._instruction = m.rerank.instruction
        self.last_canary: RerankCanaryResult | None = None

    # -- start-up -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Before a reranker's replica serves: its engine scores pairs, and it orders the known
        triple right (raises otherwise, so the replica never comes up). Nothing for embedders."""
        if self._m.task == "rerank":
            self.check_engine()
            await self.prove()

    def check_engine(self) -> None:
        """A ``task: rerank`` model must be what vLLM scores pairs with."""
        info = self._path.info
        if info.pooling_task != "classify":
            raise RuntimeError(
                f"model '{self._m.name}' is task: rerank, but vLLM runs it as an embedding "
                f"model (pooling task {info.pooling_task!r}): it needs a sequence-"
                "classification head, or its family's hf_overrides (engine/rerank_models.py)")
        if self.family is None or self.family.template is None:
            pair = self._path.hf_tokenizer("q", "d")
            if any(pair.get("token_type_ids") or []):
                raise RuntimeError(
                    f"model '{self._m.name}': its tokenizer gives pairs token type ids, which "
                    "embedfleet does not pass to the engine yet; its scores would be wrong")

    async def prove(self) -> RerankCanaryResult:
        """The ordering canary; raises ``RerankCanaryFailed`` when the model orders it wrong."""
        t = self._m.rerank.canary
        query, relevant, irrelevant = (t.query, t.relevant, t.irrelevant) if t else DEFAULT_TRIPLE
        ids, _ = self.pair_ids(query, [relevant, irrelevant], truncate=True)
        engine = self._path._gate.engine
        assert engine is not None
        result = await run_rerank_canary(engine, ids, label=f"rerank-canary-{self._m.name}")
        self.last_canary = result
        if not result.passed:
            logger.error("rerank canary FAILED for %s: %s", self._m.name, result.detail)
            raise RerankCanaryFailed(f"model '{self._m.name}': {result.detail}")
        logger.info("rerank canary of %s: %s", self._m.name, result.detail)
        return result

    # -- pairs ----------------------------------------------------------------------------------
    def _encode(self, query: str, docs: list[str]) -> list[list[int]]:
        tmpl = self.family.template if self.family else None
        if tmpl is not None:
            return self._path.preparer.tokenizer(
                [tmpl.render(query, d, self._instruction) for d in docs])
        tok = self._path.hf_tokenizer
        return [list(x) for x in tok([query] * len(docs), docs)["input_ids"]]

    def pair_ids(self, query: str, docs: list[str], *, truncate: bool
                 ) -> tuple[list[list[int]], int]:
        """Each pair's token ids, within the model's context (cutting documents if ``truncate``,
        else 400); and how many pairs were cut."""
        limit, ids = self._path.info.max_model_len, self._encode(query, docs)
        cut = 0
        for i, seq in enumerate(ids):
            if len(seq) <= limit:
                continue
            if not truncate:
                raise InputTooLong(
                    f"texts[{i}] with the query makes {len(seq)} tokens, more than model "
                    f"'{self._m.name}''s context of {limit}; shorten it or send truncate: true",
                    param="texts")
            doc, over = docs[i], len(seq) - limit
            for _ in range(TRUNCATE_PASSES):
                doc = self._cut(doc, over)
                seq = self._encode(query, [doc])[0]
                over = len(seq) - limit
                if over <= 0:
                    break
            if over > 0:
                raise InputTooLong(f"the query alone fills model '{self._m.name}''s context of "
                                   f"{limit} tokens; shorten it", param="query")
            ids[i], cut = seq, cut + 1
        return ids, cut

    def _cut(self, doc: str, over: int) -> str:
        tok = self._path.hf_tokenizer
        doc_ids = tok(doc, add_special_tokens=False)["input_ids"]
        return tok.decode(doc_ids[:max(0, len(doc_ids) - over - 1)])

    # -- one call -------------------------------------------------------------------------------
    async def rerank(self, call: RerankCall) -> RerankResult:
        if self._m.task != "rerank":
            raise InvalidParameterValue(
                f"model '{self._m.name}' is an embedding model (task: embed); it does not "
                "rerank: send this to a model with task: rerank", param="model")
        t0 = time.perf_counter()
        path = self._path
        if len(call.query) + sum(len(d) for d in call.documents) > THREAD_TOKENIZE_CHARS:
            ids, _ = await asyncio.to_thread(self.pair_ids, call.query, call.documents,
                                             truncate=call.truncate)
        else:
            ids, _ = self.pair_ids(call.query, call.documents, truncate=call.truncate)
        tokens = sum(len(s) for s in ids)
        if tokens > path.max_tokens:
            raise RequestTooLarge(
                f"the request's pairs make {tokens} tokens to score, more than model "
                f"'{self._m.name}''s limits.max_tokens of {path.max_tokens}; split the "
                "documents over several requests", param="texts")
        lane: Lane = ("bulk" if call.lane == "bulk" or tokens > path._large_call_tokens
                      else "interactive")
        as_embed = EmbedCall([], call.request_id, call.model, normalize=not call.raw_scores,
                             lane=call.lane)
        # the pairs are independent sequences: admitted in parts, they fill the engine's steps
        out = await path._runs(ids, as_embed, lane, in_parts=True)
        cached = sum(e.num_cached_tokens for e in out)
        path._record(tokens, cached, (), time.perf_counter() - t0)
        return RerankResult([float(e.vector.reshape(-1)[0]) for e in out], tokens, cached,
                            path._replica_id, path.fingerprint())
