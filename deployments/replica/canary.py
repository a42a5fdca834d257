"""The prefix-cache canary: proof, at run time, that a cache hit gives the cold vector.

vLLM-Ascend 0.13–0.17 computed pooling attention without reading the KV cache, so a prefix-cache
hit silently returned an embedding computed without its prefix (cosine ~0.58 to the true vector)
while the first, cold request looked right. A version table cannot be trusted to catch every such
path (the int8 "C8" KV path still has it in 0.18), so every replica with prefix caching on runs this
canary at start-up and every ``canary_interval_s``:

1. a probe with a fresh nonce at the front (so nothing is cached) is embedded cold;
2. every probe (they share a prefix of many KV blocks) is embedded with
   ``skip_reading_prefix_cache`` — the reference computed without reading the cache;
3. every probe is embedded again normally — these must hit the cache;
4. the lowest cosine of hit vs reference and hit vs cold is judged against a floor.

The floor is calibrated, not fixed. A cache hit runs other kernels than a cold pass (attention
over cached KV blocks), so on a card in bf16 its vector may differ from the cold one in the last
digits without being wrong; vllm-ascend's own prefix-cache embedding test accepts cosine ≥ 0.99
(tolerance 1e-2), while the corruption this guards against reads ~0.58. So at start the replica
embeds the probes cold twice (``calibrate_floor``): their spread is the path's own noise, and the
floor is 1 − ``SPREAD_MARGIN`` × that spread, no looser than vllm-ascend's tolerance, bounded to
[``FAIL_COSINE``, ``STRICT_FLOOR``]. A deterministic path (CPU) spreads by 0 and keeps the strict
floor. The verdict:

* ``passed``       — cache hits seen and every cosine ≥ the floor;
* ``failed``       — a cosine below ``FAIL_COSINE`` (0.99): the cache changes results. The caller
                     switches prefix caching off for the model, fleet-wide;
* ``inconclusive`` — no cache hit seen (nothing proven), or the lowest cosine between
                     ``FAIL_COSINE`` and the floor: closer than any corruption, looser than this
                     path's own noise. Rerun and alerted on, never a fleet-wide switch: a noisy
                     card must not turn the model's prefix caching off everywhere.

A reranker's engine scores instead of embedding (one number a sequence, sigmoid's in [0, 1]):
there the "cosine" of a pair of results is their agreement, 1 − |Δscore| (``_agree``), so the same
floor and verdicts hold (failed: scores 0.01 apart). A reranker also has an ordering canary
(``run_rerank_canary``): a known (query, relevant, irrelevant) triple must order correctly, or the
replica is marked down; a wrong ``hf_overrides`` (swapped yes/no tokens) fails it.

``passed`` is True only for ``passed``. The replica reruns inconclusive canaries
(``embedfleet.deployments.replica.prefix_cache``) and shows the verdict, the lowest cosine and
the floor in ``/v1/models`` and ``embedfleet_canary_{verdict,last_cosine,floor}``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from ..engine.vllm_engine import EmbeddingEngine

# Below this, cache hits are wrong: vllm-ascend 0.23's prefix-cache embedding test
# (tests/e2e/pull_request/one_card/pooling/test_embedding.py) accepts cosine >= 1 - 1e-2.
FAIL_COSINE = 0.99
# The floor where the path is deterministic (two cold runs agree): a hit must then match the cold
# vector but for float rounding of another kernel order.
STRICT_FLOOR = 0.99999
# A hit runs other kernels than a cold pass, so its distance from the cold vector may exceed two
# cold passes' by more than their own spread; ten times that spread is still far from corruption.
SPREAD_MARGIN = 10.0
# Long enough to span many KV blocks on every platform (block 32 on CPU, 64-128 on NPUs).
_PREFIX = (
    "Instruct: Given a legal question, retrieve the passages of statutes, regulations and court "
    "decisions that answer it. Consider the jurisdiction, the date of the decision, the parties, "
    "the procedural history, the holding and the reasoning of the court, and prefer primary "
    "sources over commentary. "
) * 6
PROBE_QUERIES = (
    "Query: Is a contract without consideration enforceable?",
    "Query: What is the limitation period for a claim in tort?",
    "Query: When may a landlord withhold a security deposit?",
    "Query: Does an oral agreement to sell land bind the parties?",
)


Verdict = Literal["passed", "failed", "inconclusive"]
VERDICTS: tuple[Verdict, ...] = ("passed", "failed", "inconclusive")


@dataclass(frozen=True)
class CanaryFloor:
    """The floor a replica's canary judges by, from two cold runs of the probes."""

    floor: float
    cold_min_cosine: float  # lowest cosine between the two cold runs: the path's own spread
    detail: str


@dataclass(frozen=True)
class CanaryResult:
    verdict: Verdict
    min_cosine: float
    cached_tokens: int
    prefix_tokens: int
    probes: int
    at: float
    detail: str
    floor: float = STRICT_FLOOR

    @property
    def passed(self) -> bool:
        return self.verdict == "passed"

    @property
    def conclusive(self) -> bool:
        return self.verdict != "inconclusive"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed, "conclusive": self.conclusive}


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def _agree(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine of two vectors; 1 − |Δ| of two scores (a one-number "vector" has cosine ±1)."""
    if a.size == 1 and b.size == 1:
        return 1.0 - abs(float(a.reshape(-1)[0]) - float(b.reshape(-1)[0]))
    return _cos(a, b)


def floor_from_spread(cold_min_cosine: float) -> float:
    """The floor for a path whose two cold runs agree to ``cold_min_cosine``: the tighter of
    1 − ``SPREAD_MARGIN`` × spread and vllm-ascend's tolerance, within [FAIL_COSINE,
    STRICT_FLOOR]."""
    spread = max(0.0, 1.0 - cold_min_cosine)
    return min(STRICT_FLOOR, max(FAIL_COSINE, 1.0 - SPREAD_MARGIN * spread))


def judge(min_cosine: float, cached_tokens: int, floor: float) -> Verdict:
    """The verdict of one canary run (see the module docstring)."""
    if min_cosine < FAIL_COSINE:
        return "failed" if cached_tokens else "inconclusive"
    if cached_tokens == 0 or min_cosine < floor:
        return "inconclusive"
    return "passed"


def _probe_ids(engine: EmbeddingEngine, label: str) -> tuple[str, list[list[int]], int]:
    nonce = uuid.uuid4().hex[:12]
    prefix = f"[{label} {nonce}] {_PREFIX}"
    ids = engine.tokenize([prefix + q for q in PROBE_QUERIES])
    return nonce, ids, len(engine.tokenize([prefix])[0])


async def calibrate_floor(engine: EmbeddingEngine, *, label: str = "canary-floor") -> CanaryFloor:
    """Embed the probes cold twice (never reading the cache) and derive the floor."""
    nonce, ids, _ = _probe_ids(engine, label)
    rid = f"{label}-{nonce}"
    first = await engine.embed(ids, request_id=f"{rid}-a", skip_prefix_cache=True)
    second = await engine.embed(ids, request_id=f"{rid}-b", skip_prefix_cache=True)
    low = min(_agree(a.vector, b.vector) for a, b in zip(first, second))
    floor = floor_from_spread(low)
    return CanaryFloor(floor, low, f"two cold runs of {len(ids)} probes agree to cosine "
                                   f"{low:.7f}; floor {floor:.6f}")


async def run_canary(engine: EmbeddingEngine, *, label: str = "canary",
                     floor: float = STRICT_FLOOR) -> CanaryResult:
    nonce, ids, prefix_tokens = _probe_ids(engine, label)
    rid = f"{label}-{nonce}"
    cold = (await engine.embed(ids[:1], request_id=f"{rid}-cold"))[0]
    reference = await engine.embed(ids, request_id=f"{rid}-noread", skip_prefix_cache=True)
    hits = await engine.embed(ids, request_id=f"{rid}-hit")
    cosines = [_agree(h.vector, r.vector) for h, r in zip(hits, reference)]
    cosines.append(_agree(hits[0].vector, cold.vector))
    cached = sum(h.num_cached_tokens for h in hits)
    low = min(cosines)
    verdict = judge(low, cached, floor)
    if cold.num_cached_tokens:
        detail = f"cold probe unexpectedly hit the cache ({cold.num_cached_tokens} tokens)"
    else:
        detail = (f"min cosine {low:.6f} over {len(cosines)} cache-hit/cold pairs, "
                  f"{cached} cached tokens, floor {floor:.6f}")
    if cached == 0:
        detail = "inconclusive: no cache hits observed, nothing proven; " + detail
    elif verdict == "inconclusive":
        detail = (f"inconclusive: cache hits differ from cold vectors by more than this path's "
                  f"own noise, yet less than any corruption (fails below {FAIL_COSINE}); "
                  + detail)
    elif verdict == "failed":
        detail = f"cache hits differ from cold vectors: {detail} (fails below {FAIL_COSINE})"
    return CanaryResult(verdict, low, cached, prefix_tokens, len(ids), time.time(), detail,
                        floor)


# -- the reranker's ordering canary ------------------------------------------------------------

# A triple any trained reranker orders: the relevant document answers the query, the irrelevant
# one shares no topic with it. A model whose weights cannot know this (the random-weight test
# models) names its own in the config (``rerank.canary``).
DEFAULT_TRIPLE = ("What is the capital of France?",
                  "Paris is the capital and largest city of France.",
                  "Photosynthesis converts light energy into chemical energy in plants.")


@dataclass(frozen=True)
class RerankCanaryResult:
    passed: bool
    relevant: float
    irrelevant: float
    detail: str


class RerankCanaryFailed(RuntimeError):
    """The reranker orders its known triple wrong: its scores would be silently meaningless
    (a wrong hf_overrides), so the replica must not serve."""


async def run_rerank_canary(engine: EmbeddingEngine, pair_ids: list[list[int]], *,
                            label: str = "rerank-canary") -> RerankCanaryResult:
    """``pair_ids``: the rendered (query, relevant) and (query, irrelevant) pairs, tokenised.
    Scored cold (never reading the cache), as every request's result must be."""
    rid = f"{label}-{uuid.uuid4().hex[:12]}"
    rel, irr = (float(e.vector.reshape(-1)[0]) for e in
                await engine.embed(pair_ids, request_id=rid, skip_prefix_cache=True))
    passed = rel > irr
    detail = (f"known triple: relevant {rel:.6f} {'>' if passed else '<='} irrelevant "
              f"{irr:.6f}" + ("" if passed else "; the model orders it wrong: check its "
                              "hf_overrides (engine/rerank_models.py) and rerank.canary"))
    return RerankCanaryResult(passed, rel, irr, detail)
