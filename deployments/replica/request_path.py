"""The replica's request path: prepare the call, wait for the owner queue, embed, finish.

One queue per replica — the admission queue (``replica.admission``) — decides what runs:
it admits calls by sequences and tokens (the governor's budget) and hands admitted pieces straight
to the engine, whose own scheduler (vLLM's) batches them. There is no batcher in between:
vLLM re-batched whatever a batcher grouped, so it only added a wait and a copy. A bulk-lane call
is admitted and sent in runs of at most what bulk may hold in flight (``_run_end``), so queries
arriving during a flood find drain-sized engine steps ahead of them. A large interactive call
(more than ``large_call_tokens``: many inputs, or one long input's chunks) goes in runs the same
way, each admitted in the interactive lane behind the queries that came meanwhile, and at bulk's
vLLM priority: one giant request is one slow client, never a stalled card, and a corpus job's
full bulk lane never refuses it (it is an interactive caller's).

A call's tokens are bounded (``max_tokens``, the model's ``limits``) once it is tokenised and
planned, before any of it is admitted: 413 past it.

Tokenizing long inputs moves off the event loop (a thread), so one big request does not stall
every other call's bookkeeping; a short one is tokenized in place (a thread hop costs more).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import numpy as np

from ..common import metrics
from ..common.contracts import EmbedCall, EmbedResult, Fingerprint, Lane
from ..engine.gate import EngineGate
from ..engine.vllm_engine import Embedding, EmbeddingEngine, EngineInfo
from ..common.errors import EmbedfleetError, EngineUnavailable, RequestTooLarge
from .admission import AdmissionBudget
from .inputs import InputPreparer, PreparedCall
from ..common.long_input import SpecialTokens
from ..common.prompts import PromptTemplates
from ..common.long_input import LongInputPolicy

# vLLM's priority per lane (lower is scheduled first, with engine.scheduling_policy: priority).
LANE_PRIORITY = {"interactive": 0, "bulk": 1}
# Characters above which a call's texts are tokenized in a worker thread.
THREAD_TOKENIZE_CHARS = 16_384
# A call admitted in parts (a reranker's pairs) goes in parts of at most this fraction of the
# token budget.
ADMIT_PARTS = 8
# Times a call is sent again after an engine swap shut its engine down under it (one swap each).
SWAP_RESENDS = 2


class RequestPath:
    def __init__(self, *, model: str, gate: EngineGate[EmbeddingEngine], queue: AdmissionBudget,
                 long_input: LongInputPolicy, prompts: PromptTemplates | None,
                 reads_cache: Callable[[], bool], fingerprint: Callable[[], Fingerprint],
                 replica_id: str, hold_s: float, retry_after_s: float,
                 recorder: metrics.Batched, card_tags: dict[str, str], max_tokens: int,
                 large_call_tokens: int) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self._large_call_tokens = large_call_tokens
        self._gate = gate
        self.queue = queue
        self._long_input = long_input
        self._prompts = prompts
        self._reads_cache = reads_cache
        self.fingerprint = fingerprint
        self._replica_id = replica_id
        self._hold_s = hold_s
        self._retry_after_s = retry_after_s
        self._rec = recorder
        self._tag = {"model": model}
        self._card_tag = {"model": model, **card_tags}  # per-replica prefix-cache hit ratio
        self.inflight_sequences = 0
        self.inflight_tokens = 0
        self.last_progress = time.monotonic()
        self.engine_failed = False
        engine = gate.engine
        assert engine is not None
        self.use_engine(engine)

    def on_engine_failure(self, engine: EmbeddingEngine) -> None:
        """Called once when ``engine`` dies in a step; the replica sets its own: it reports the
        death to the memory governor as an OOM (which cuts this card before the next engine
        gets the same load) and restarts the engine in place (``replica/engine_restart.py``),
        closing the gate first, so this call and the others of that step run again on the new
        engine. Left as is (nothing restarts it), the call fails with 503 + Retry-After."""

    def use_engine(self, engine: EmbeddingEngine) -> None:
        """Follow the engine the gate holds (a swap replaces it); a failure of the old engine
        says nothing of the new one."""
        self.engine_failed = False
        self.info: EngineInfo = engine.info
        self.hf_tokenizer = engine.hf_tokenizer
        self.preparer = InputPreparer(engine.info, engine.tokenize,
                                      SpecialTokens.from_tokenizer(engine.hf_tokenizer),
                                      self._long_input, self._prompts)

    # -- one call ----------------------------------------------------------------------------
    async def embed(self, call: EmbedCall) -> EmbedResult:
        t0 = time.perf_counter()
        prepared = await self._prepare(call)
        if prepared.piece_tokens > self.max_tokens:
            raise RequestTooLarge(
                f"the request's inputs make {prepared.piece_tokens} tokens to embed (chunk "
                f"windows included), more than model '{self.model}''s limits.max_tokens of "
                f"{self.max_tokens}; split it over several requests", param=self.preparer.param)
        large = call.lane == "bulk" or prepared.piece_tokens > self._large_call_tokens
        out = await self._runs(prepared.pieces, call, "bulk" if large else "interactive")
        vectors = self.preparer.finish(prepared, [e.vector for e in out],
                                       dimensions=call.dimensions, normalize=call.normalize)
        cached = sum(e.num_cached_tokens for e in out)
        report = prepared.report()
        self._record(prepared.piece_tokens, cached, report, time.perf_counter() - t0)
        return EmbedResult(np.stack(vectors).astype(np.float32, copy=False),
                           prepared.input_tokens, cached, self._replica_id, self.fingerprint(),
                           report)

    async def _runs(self, pieces: list[list[int]], call: EmbedCall, schedule: Lane,
                    in_parts: bool = False) -> list[Embedding]:
        """The call's pieces through the owner queue and the engine: one run for an interactive
        call; a bulk or a large call (``schedule`` bulk) in drain-sized runs (``_run_end``) at
        bulk's vLLM priority, each run admitted in the call's own lane (``follows``). One call's
        vectors come from one engine (the chunks of a long input are merged): a swap between two
        runs (prefix caching switched) sends the call again. ``in_parts``: an interactive call
        is admitted in parts at once (``_parts``), not whole."""
        for _ in range(SWAP_RESENDS + 1):
            out: list[Embedding] = []
            engines: list[EmbeddingEngine] = []
            start = 0
            if in_parts and schedule == "interactive" and pieces:
                out, engines = await self._admitted_parts(pieces, call)
                start = len(pieces)
            while start < len(pieces):
                end = self._run_end(pieces, start, schedule, call.lane)
                got, engine = await self._admitted_run(pieces[start:end], call, schedule,
                                                       start > 0)
                out += got
                engines.append(engine)
                start = end
            if all(e is engines[0] for e in engines):
                return out
        raise EngineUnavailable(f"replica {self._replica_id}: its engine was replaced under "
                                "every try of a call in runs or parts",
                                retry_after_s=self._retry_after_s)

    def _run_end(self, pieces: list[list[int]], start: int, lane: Lane,
                 call_lane: Lane = "bulk") -> int:
        """Where the run that starts at ``start`` ends. A bulk call goes to the engine in runs of
        at most the tokens bulk may hold in flight now (``AdmissionBudget.bulk_token_cap``: what
        the card drains in ``bulk_max_drain_s`` while queries come), each admitted on its own:
        vLLM cannot pause a step, so a query arriving during a flood waits for the bulk work
        already in the engine, and a whole 32-text call was the floor of that wait (145 ms a
        step on one core of this machine). Within bulk's sequence share too, so a run is never
        oversize. At least one piece per run: a piece is not split. A large interactive call's
        runs are sized the same (they run at bulk's priority in the engine) and also at most
        ``large_call_tokens``: until the card's drain rate is known, bulk's cap is its whole
        share, a second or more of work on a slow card."""
        if lane != "bulk":
            return len(pieces)
        cap = self.queue.bulk_token_cap
        if call_lane != "bulk":
            cap = min(cap, self._large_call_tokens)
        return _packed_end(pieces, start, cap, min(len(pieces), start + self.queue.bulk_seq_cap))

    def _parts(self, pieces: list[list[int]]) -> list[list[list[int]]]:
        """A call's pieces in consecutive parts of at most an eighth of the token budget (at
        least one piece each). Admitted whole, a call that is a large share of the budget waits
        until that much is free, and the engine runs steps the budget leaves partly empty
        (one 4,800-token rerank call at a time in an 8,192-token budget); in parts, each goes
        to the engine as soon as it fits, and in-flight tokens stay within the budget."""
        grain = max(1, self.queue.limits[1] // ADMIT_PARTS)
        parts, start = [], 0
        while start < len(pieces):
            end = _packed_end(pieces, start, grain, len(pieces))
            parts.append(pieces[start:end])
            start = end
        return parts

    async def _admitted_parts(self, pieces: list[list[int]], call: EmbedCall
                              ) -> tuple[list[Embedding], list[EmbeddingEngine]]:
        """The call's parts (``_parts``), each sent to the engine as soon as it is admitted,
        while the next one queues: the first as a new call (it may be refused, 429), the others
        as its followers once it is in. One waiter a call at a time, as a call in runs, so the
        queue's limits and its refusals count calls, not parts. The first part to fail cancels
        the others (their budget is handed back)."""
        tasks: list[asyncio.Task] = []
        try:
            for k, part in enumerate(self._parts(pieces)):
                admitted = asyncio.Event()
                tasks.append(asyncio.ensure_future(
                    self._admitted_run(part, call, "interactive", k > 0, admitted)))
                waiting = asyncio.ensure_future(admitted.wait())
                await asyncio.wait((tasks[-1], waiting), return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
                if tasks[-1].done():
                    tasks[-1].result()  # refused, or failed: raises
            done = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [e for got, _ in done for e in got], [engine for _, engine in done]

    async def _admitted_run(self, run: list[list[int]], call: EmbedCall, schedule: Lane,
                            follows: bool, admitted: asyncio.Event | None = None
                            ) -> tuple[list[Embedding], EmbeddingEngine]:
        """One run admitted in the call's lane, then embedded at ``schedule``'s vLLM priority;
        with the engine that embedded it."""
        n_tokens = sum(len(p) for p in run)
        async with self.queue.admit(len(run), n_tokens, lane=call.lane, follows=follows,
                                    runs=schedule == "bulk"):
            if admitted is not None:
                admitted.set()
            self.inflight_sequences += len(run)
            self.inflight_tokens += n_tokens
            self._rec.observe("embedfleet_engine_batch_size", len(run), self._tag)
            try:
                return await self._engine_call(run, call.normalize, LANE_PRIORITY[schedule])
            finally:
                self.inflight_sequences -= len(run)
                self.inflight_tokens -= n_tokens

    async def _prepare(self, call: EmbedCall) -> PreparedCall:
        def prepare() -> PreparedCall:
            return self.preparer.prepare(call.inputs, policy=call.long_input,
                                         prompt_name=call.prompt_name, task=call.task,
                                         dimensions=call.dimensions)

        texts = call.inputs and isinstance(call.inputs[0], str)
        if texts and sum(len(t) for t in call.inputs) > THREAD_TOKENIZE_CHARS:  # type: ignore
            return await asyncio.to_thread(prepare)
        return prepare()

    async def _engine_call(self, pieces: list[list[int]], normalize: bool,
                           priority: int) -> tuple[list[Embedding], EmbeddingEngine]:
        """Admitted pieces straight into the engine. While the engine is being replaced the call
        waits at the gate (up to the model's ``cold_start_hold_s``), then runs on the new one.
        A call still on the old engine when the swap shut it down (its drain bound ran out)
        waits at the gate again and runs on the new engine: the engine was retired, not broken,
        so neither the call nor the replica's health pays for it."""
        resends = 0
        while True:
            async with self._gate.use(self._hold_s, self._retry_after_s) as engine:
                skip = engine.info.prefix_caching and not self._reads_cache()
                try:
                    out = await engine.embed(pieces, request_id=f"e-{uuid.uuid4().hex[:12]}",
                                             skip_prefix_cache=skip, normalize=normalize,
                                             priority=priority)
                except (EmbedfleetError, asyncio.CancelledError):
                    raise
                except Exception as exc:
                    if self._gate.engine is engine and not self.engine_failed:
                        # The engine-core process died (an OOM in a step cannot be told from
                        # another death once the core is gone): once per engine, not per call.
                        self.engine_failed = True
                        self.on_engine_failure(engine)
                    # Taken by a swap, or being restarted after its death: the inputs are
                    # idempotent, so the call waits at the gate and runs on the new engine.
                    replaced = self._gate.engine is not engine or not self._gate.is_open
                    if replaced and resends < SWAP_RESENDS:
                        resends += 1
                        continue
                    # Nothing replaces it here: the call is safe to retry elsewhere, and the
                    # next health check makes Serve replace this replica.
                    raise EngineUnavailable(f"engine of replica {self._replica_id} failed: "
                                            f"{type(exc).__name__}", retry_after_s=1) from None
            self.last_progress = time.monotonic()
            return out, engine

    def _record(self, tokens: int, cached: int, report, seconds: float) -> None:
        rec, tag = self._rec, self._tag
        rec.inc("embedfleet_prompt_tokens_total", tokens, self._card_tag)
        if cached:
            rec.inc("embedfleet_prefix_cache_hit_tokens_total", cached, self._card_tag)
        truncated = [r for r in report if r.truncated]
        if truncated:
            rec.inc("embedfleet_truncated_inputs_total", len(truncated), tag)
            rec.inc("embedfleet_dropped_tokens_total", sum(r.dropped_tokens for r in truncated),
                    tag)
        chunks = sum(r.chunks for r in report if r.chunks > 1)
        if chunks:
            rec.inc("embedfleet_chunks_total", chunks, tag)
        rec.observe("embedfleet_engine_latency_seconds", seconds, tag)


def _packed_end(pieces: list[list[int]], start: int, cap: float, stop: int) -> int:
    """Where a run of ``pieces`` from ``start`` ends: as many as fit ``cap`` tokens, before
    ``stop``, and at least one (a piece is not split)."""
    end, tokens = start + 1, len(pieces[start])
    while end < stop and tokens + len(pieces[end]) <= cap:
        tokens += len(pieces[end])
        end += 1
    return end
