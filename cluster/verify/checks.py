"""The checks of `embedfleet verify` (reference, batch invariance, cache hit vs cold, golden) on a
fixed built-in corpus, and ``verify_model``, which runs every check for one model.

Each check returns a ``CheckResult``; a server error fails the check it hit, not the command.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .client import Embedded, EmbeddingsClient, ServerError
from .golden import GoldenEntry, fingerprint_diff
from .reference import Reference

# Batching and cache hits may change float summation order, nothing else: near-identity.
EXACT_COSINE = 0.99999
CACHE_PREFIX_MIN_TOKENS = 300  # several KV blocks at any block size vLLM uses
NORM_TOLERANCE = 1e-3          # |served norm / reference norm - 1|
HIT_ATTEMPTS = 3               # with several replicas, a repeat may land on one without the cache
SHUFFLE_SEED = 20240607

REFERENCE, BATCH, CACHE, GOLDEN = "reference", "batch invariance", "cache hit vs cold", "golden"
Status = Literal["PASS", "FAIL", "SKIP"]

# -- the corpus: short, long, unicode, code -----------------------------------------------------
_LONG = ("Embedding servers are judged on two things: how many texts per second they turn into "
         "vectors on a given card, and whether those vectors are the ones the model's authors "
         "would compute. The second is easy to lose without noticing. A different attention "
         "kernel, a batch that pads differently, a prefix cache that serves stale key-value "
         "blocks, or a quantised KV cache can each move a vector a little; a retrieval index "
         "built from vectors of one kind and queried with vectors of another then degrades "
         "quietly. That is why this corpus mixes lengths, scripts and code, and why each vector "
         "is compared with a reference computed from the same weights. Golden files extend the "
         "comparison across machines and releases: vectors saved on one platform, with the "
         "fingerprint of the weights, dtype and engine that made them, are compared with what "
         "another platform serves today, so a change shows up before an index is rebuilt.")
CORPUS: tuple[str, ...] = (
    "hello", "A", "What is the capital of France?", "how do I reset my password",
    "The quick brown fox jumps over the lazy dog.",
    "Retrieval-augmented generation combines a search index with a language model.",
    "Paris is the capital and most populous city of France, on the Seine.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The 2024 budget allocates $3.2 billion (≈ €2.9bn) to rail, up 12% year on year.",
    "Ünïcödé àccents: café, naïve, Straße, São Paulo, Øresund, Kraków.",
    "机器学习是人工智能的一个分支，研究计算机如何从数据中学习。", "東京は日本の首都であり、世界最大級の都市圏を持つ。",
    "Привет, мир! Это проверка кириллицы.", "مرحبا بالعالم، هذا اختبار للنص العربي.",
    "Emoji in text 🚀🔥 should not break tokenisation 👍",
    "def add(a: int, b: int) -> int:\n    return a + b\n",
    "SELECT name, COUNT(*) FROM users WHERE active = 1 GROUP BY name ORDER BY 2 DESC;",
    '{"model": "all-minilm-l6-v2", "input": ["a", "b"], "encoding_format": "float"}',
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // dot product",
    "https://example.com/path?query=embedding&lang=en#section-2", "E = mc^2; ∑_{i=1}^{n} x_i² ≥ 0",
    "   leading and trailing whitespace,\ttabs and\nnewlines   ",
    "buffalo buffalo buffalo buffalo buffalo buffalo buffalo buffalo", _LONG)
SHARED_PREFIX = (
    "Instruct: You are given a question from a customer of a software company together with the "
    "product it concerns. Retrieve the documentation passages, release notes, troubleshooting "
    "guides and community answers that best help the customer solve the problem, preferring "
    "official documentation for the installed version, then recent release notes, then guides "
    "that were confirmed to work, and finally answers from the community forum. ") * 5
CACHE_SUFFIXES = ("Query: the installer stops at 90 percent on Windows",
                  "Query: how do I rotate the API keys without downtime",
                  "Query: export every dashboard as PDF")
CACHE_SIBLING = "Query: where are the log files"


# -- checks --------------------------------------------------------------------------------------
@dataclass
class CheckResult:
    name: str
    status: Status
    threshold: float | None = None
    cosines: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def min(self) -> float | None:
        return min(self.cosines) if self.cosines else None

    @property
    def mean(self) -> float | None:
        return float(np.mean(self.cosines)) if self.cosines else None

    def below(self) -> list[tuple[str, float]]:
        return [(t, c) for t, c in zip(self.texts, self.cosines) if c < (self.threshold or 0)]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "threshold": self.threshold,
                "min": self.min, "mean": self.mean, "n": len(self.cosines), "note": self.note,
                "per_text": [{"text": t, "cosine": c} for t, c in zip(self.texts, self.cosines)],
                **self.details}


def cosines(a: np.ndarray, b: np.ndarray) -> list[float]:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return (np.sum(a * b, axis=1) / np.maximum(den, 1e-30)).tolist()


def judge(name: str, cos: list[float], texts: Sequence[str], threshold: float,
          problems: Sequence[str] = (), note: str = "", **details: Any) -> CheckResult:
    result = CheckResult(name, "PASS", threshold, list(cos), list(texts), note, details)
    low = result.below()
    if low:
        problems = [f"{len(low)} of {len(cos)} text(s) below {threshold}", *problems]
    if problems:
        result.status = "FAIL"
        result.note = "; ".join([*problems, *([note] if note else [])])
    return result


def check_reference(ref: Reference, texts: Sequence[str], served: np.ndarray, threshold: float,
                    served_digest: str | None) -> CheckResult:
    expected = ref.embed(texts)
    # Cosine ignores length; a model that normalises must serve unit vectors, one that does not
    # the reference's lengths.
    ratio = np.linalg.norm(served.astype(np.float64), axis=1) / \
        np.linalg.norm(expected.astype(np.float64), axis=1)
    problems = [f"served norms are {ratio.min():.4f}–{ratio.max():.4f}× the reference's"] \
        if np.max(np.abs(ratio - 1)) > NORM_TOLERANCE else []
    note = f"{ref.pooling.kind} pooling ({ref.pooling.source})" + \
        (", L2-normalised" if ref.pooling.normalize else "")
    if served_digest and served_digest != ref.digest:  # a note: a re-saved copy differs too
        note += f"; reference folder digest {ref.digest} ≠ served {served_digest}"
    return judge(REFERENCE, cosines(served, expected), texts, threshold, problems, note,
                 pooling=ref.pooling.kind, normalize=ref.pooling.normalize)


def check_batch(client: EmbeddingsClient, model: str, texts: Sequence[str],
                alone: np.ndarray) -> tuple[CheckResult, Embedded]:
    """Alone vs shuffled batch; also returns the batch answer in corpus order."""
    order = list(range(len(texts)))
    random.Random(SHUFFLE_SEED).shuffle(order)
    resp = client.embed(model, [texts[i] for i in order])
    batched = np.empty_like(resp.vectors)
    batched[order] = resp.vectors
    in_order = Embedded(batched, resp.prompt_tokens, resp.cached_tokens, resp.fingerprint)
    return judge(BATCH, cosines(alone, batched), texts, EXACT_COSINE), in_order


def _until_hit(client: EmbeddingsClient, model: str, text: str) -> Embedded:
    for _ in range(HIT_ATTEMPTS):
        resp = client.embed(model, [text])
        if resp.cached_tokens > 0:
            break
    return resp


def check_cache(client: EmbeddingsClient, model: str, info: dict[str, Any],
                max_tokens: Callable[[str], int] | None = None) -> CheckResult:
    pc = info.get("prefix_cache") or {}
    if pc.get("enabled") is not True:
        state = "off" if pc.get("enabled") is False else "unknown"
        return CheckResult(CACHE, "SKIP", note=f"prefix caching {state}: {pc.get('reason', '')}")
    limit = info.get("max_input_tokens")
    longest = SHARED_PREFIX + max(CACHE_SUFFIXES, key=len)
    if max_tokens and limit and max_tokens(longest) > limit:
        return CheckResult(CACHE, "SKIP", note=f"max_input_tokens {limit} is below the "
                           f"{max_tokens(longest)}-token shared-prefix texts")
    cos, labels, problems, hits, prompts = [], [], [], [], []
    run = time.time_ns()
    for i, suffix in enumerate(CACHE_SUFFIXES):
        head = f"[embedfleet verify {run}-{i}] {SHARED_PREFIX}"  # never cached before this run
        text = head + suffix
        cold = client.embed(model, [text])
        if cold.cached_tokens:
            problems.append(f"text {i}: the cold request already hit the cache "
                            f"({cold.cached_tokens} tokens): inconclusive")
        _until_hit(client, model, head + CACHE_SIBLING)  # another text with the same prefix
        warm = _until_hit(client, model, text)
        if warm.cached_tokens == 0:
            problems.append(f"text {i}: no cache hit reported on the repeat (cached_tokens=0)")
        cos += cosines(cold.vectors, warm.vectors)
        labels.append(suffix)
        hits.append(warm.cached_tokens)
        prompts.append(cold.prompt_tokens)
    if min(prompts) < CACHE_PREFIX_MIN_TOKENS:
        problems.append(f"only {min(prompts)} prompt tokens; the shared prefix must span "
                        f"{CACHE_PREFIX_MIN_TOKENS}+")
    return judge(CACHE, cos, labels, EXACT_COSINE, problems,
                 f"cached tokens on the repeat: {min(hits)}–{max(hits)} of {max(prompts)}",
                 cached_tokens=hits, prompt_tokens=prompts)


def check_golden(client: EmbeddingsClient, model: str, golden: GoldenEntry | None,
                 threshold: float) -> CheckResult:
    if golden is None:
        return CheckResult(GOLDEN, "SKIP", note="the golden file has no vectors for this model")
    resp = client.embed(model, golden.texts)
    diff = fingerprint_diff(golden.fingerprint, resp.fingerprint)
    note = ("fingerprint differs: " + "; ".join(diff)) if diff else "fingerprint matches"
    if resp.vectors.shape[1] != golden.vectors.shape[1]:
        return CheckResult(GOLDEN, "FAIL", threshold, note=f"dimensions differ: golden "
                           f"{golden.vectors.shape[1]}, served {resp.vectors.shape[1]}; {note}")
    return judge(GOLDEN, cosines(golden.vectors, resp.vectors), golden.texts, threshold, (),
                 note, fingerprint_differs=diff)


# -- one model -----------------------------------------------------------------------------------
@dataclass
class ModelReport:
    model: str
    fingerprint: dict[str, str]
    checks: list[CheckResult]

    @property
    def passed(self) -> bool:
        return all(c.status != "FAIL" for c in self.checks)

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "passed": self.passed, "fingerprint": self.fingerprint,
                "checks": [c.as_dict() for c in self.checks]}


def _guarded(name: str, fn: Callable[[], CheckResult]) -> CheckResult:
    try:
        return fn()
    except ServerError as exc:
        return CheckResult(name, "FAIL", note=str(exc))


def verify_model(client: EmbeddingsClient, info: dict[str, Any], ref_dir: Path | None,
                 golden: dict[str, GoldenEntry] | None, min_cosine: float,
                 corpus: Sequence[str] = CORPUS) -> tuple[ModelReport, GoldenEntry | None]:
    """Every check for one model; also the corpus vectors (for --save-golden)."""
    model, checks = info["id"], []
    ref, ref_problem = None, ""
    if ref_dir is not None:
        try:
            ref = Reference(ref_dir)
        except Exception as exc:  # any loading failure is reported, not raised
            ref_problem = f"cannot build the reference from {ref_dir}: {exc!r}"[:400]
    texts, limit = list(corpus), info.get("max_input_tokens")
    if ref is not None and limit:
        texts = [t for t, n in zip(corpus, ref.count_tokens(corpus)) if n <= limit]
    fingerprint, saved = {}, None
    try:
        alone = [client.embed(model, [t]) for t in texts]
        vectors = np.concatenate([a.vectors for a in alone])
        fingerprint = alone[0].fingerprint
        if ref is not None:
            checks.append(check_reference(ref, texts, vectors, min_cosine,
                                          fingerprint.get("x-embedfleet-model-digest")))
            if len(texts) < len(corpus):
                checks[-1].note += f"; {len(corpus) - len(texts)} text(s) over {limit} tokens " \
                    "left out"
        elif ref_problem:
            checks.append(CheckResult(REFERENCE, "FAIL", min_cosine, note=ref_problem))
        else:
            checks.append(CheckResult(REFERENCE, "SKIP", min_cosine, note="reference weights "
                                      f"unknown: pass --model-path {model}=PATH"))
        batch, saved_resp = check_batch(client, model, texts, vectors)
        checks.append(batch)
        saved = GoldenEntry(texts, saved_resp.vectors, saved_resp.fingerprint)
    except ServerError as exc:
        checks += [CheckResult(n, "FAIL", note=str(exc)) for n in (REFERENCE, BATCH)
                   if n not in {c.name for c in checks}]
    counter = (lambda t: ref.count_tokens([t])[0]) if ref is not None else None
    checks.append(_guarded(CACHE, lambda: check_cache(client, model, info, counter)))
    if golden is not None:
        checks.append(_guarded(GOLDEN, lambda: check_golden(client, model, golden.get(model),
                                                            min_cosine)))
    return ModelReport(model, fingerprint, checks), saved
