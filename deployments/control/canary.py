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
4. hit vs reference and hit vs cold must agree to cosine ≥ ``COSINE_FLOOR``.

A run that saw no cache hits proves nothing: its verdict is ``inconclusive`` and ``passed`` is
False. The replica reruns it (``embedfleet.deployments.control.prefix_cache``) and shows the verdict in
``/v1/models`` and ``embedfleet_canary_verdict``; a model whose cache never hits never reads as
proven.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from embedfleet.deployments.engine.vllm_engine import EmbeddingEngine

COSINE_FLOOR = 0.99999
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
class CanaryResult:
    verdict: Verdict
    min_cosine: float
    cached_tokens: int
    prefix_tokens: int
    probes: int
    at: float
    detail: str

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


async def run_canary(engine: EmbeddingEngine, *, label: str = "canary") -> CanaryResult:
    nonce = uuid.uuid4().hex[:12]
    prefix = f"[{label} {nonce}] {_PREFIX}"
    ids = engine.tokenize([prefix + q for q in PROBE_QUERIES])
    prefix_tokens = len(engine.tokenize([prefix])[0])
    rid = f"{label}-{nonce}"
    cold = (await engine.embed(ids[:1], request_id=f"{rid}-cold"))[0]
    reference = await engine.embed(ids, request_id=f"{rid}-noread", skip_prefix_cache=True)
    hits = await engine.embed(ids, request_id=f"{rid}-hit")
    cosines = [_cos(h.vector, r.vector) for h, r in zip(hits, reference)]
    cosines.append(_cos(hits[0].vector, cold.vector))
    cached = sum(h.num_cached_tokens for h in hits)
    low = min(cosines)
    if cold.num_cached_tokens:
        detail = f"cold probe unexpectedly hit the cache ({cold.num_cached_tokens} tokens)"
    else:
        detail = (f"min cosine {low:.6f} over {len(cosines)} cache-hit/cold pairs, "
                  f"{cached} cached tokens")
    if cached == 0:
        return CanaryResult("inconclusive", low, 0, prefix_tokens, len(ids), time.time(),
                            "inconclusive: no cache hits observed, nothing proven; " + detail)
    if low >= COSINE_FLOOR:
        return CanaryResult("passed", low, cached, prefix_tokens, len(ids), time.time(), detail)
    return CanaryResult("failed", low, cached, prefix_tokens, len(ids), time.time(),
                        f"cache hits differ from cold vectors: {detail} (floor {COSINE_FLOOR})")
