"""The `rerank` workload of `embedfleet bench`: one query + 32 documents a request, on a reranker.

    embedfleet bench --workloads rerank --peers vllm,vllm-serve,embedfleet
    embedfleet bench --workloads rerank --rerank-model /path/to/a/reranker   # another reranker

A phase of its own, after the embedding peers have stopped, because it serves another model:
the tiny random-weight Qwen3 reranker (``benchmarks/tiny_qwen3_reranker.py``, built on demand)
or ``--rerank-model``. Its peers, on the same engine arguments (``EmbedfleetConfig.
engine_kwargs`` of the one reranker config, prefix caching as embedfleet resolved it):
  embedfleet  ``POST /v1/rerank`` on a one-replica cluster of that config (started first, with
              `embedfleet up` when nothing answers at --embedfleet-url);
  vllm-serve  ``POST /v1/rerank`` on vLLM's own server. For a templated family (Qwen3-Reranker)
              the query and documents are sent rendered (``rerank_body``): vLLM scores
              ``query + document`` as one text for a reranker without a sep token, so it scores
              exactly the text embedfleet renders from the raw pair;
  vllm        the bare engine in this process, the same rendered pairs tokenised and scored by
              ``VllmEmbeddingEngine.embed`` (the classify pooling task): the engine's limit.
Infinity is skipped (it serves Qwen3-Reranker only from a converted checkpoint).

The runs are ordinary run records (``report.run_record``) whose ``texts`` are pairs, so the
summary's texts/s is pairs/s, its CPU-s per 1,000 texts is per 1,000 pairs, and the issue's goal
(embedfleet >= 1.1x vllm serve) is judged by ``report.evaluate_goals`` like the others. The
first request's scores of each peer are compared with the reference peer's (|delta| <= 1e-3).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import report as rpt
from .bench_runs import cpu_meter, start_peers
from .embedfleet_peer import EmbedfleetPeer, bench_config
from .load_driver import describe_error, drive
from .peers import VllmInProcessPeer
from .server_peers import VllmServePeer
from .workloads import WARMUP_SEED_OFFSET, mixed_documents, short_queries

DOCS_PER_REQUEST = 32  # the shape: query + 32 documents a request
REQUESTS = {"full": 48, "quick": 2}
MAX_MODEL_LEN = 1024
MAX_SCORE_DELTA = 1e-3  # the issue's |delta| bound between a peer's scores and the reference's
UNIT = "pairs: texts = (query, document) pairs, texts_per_s = pairs/s, cpu_s_per_1k = CPU-s " \
       "per 1,000 pairs"

Request = tuple[str, list[str]]


@dataclass(frozen=True)
class RerankWorkload:
    requests: list[Request]
    warmup: list[Request]
    seed: int

    @property
    def pairs(self) -> int:
        return sum(len(docs) for _, docs in self.requests)


def build_rerank(requests: int, seed: int = 0, docs: int = DOCS_PER_REQUEST,
                 warmup: int = 4) -> RerankWorkload:
    """Seeded: short queries (3-20 words), documents of 5-250 tokens (log-uniform); warm-up
    requests from another seed, so no cache has seen a measured pair."""
    def make(n: int, s: int) -> list[Request]:
        qs, ds = short_queries(n, s), mixed_documents(n * docs, s + 1)
        return [(qs[i], ds[i * docs:(i + 1) * docs]) for i in range(n)]

    return RerankWorkload(make(requests, seed), make(warmup, seed + WARMUP_SEED_OFFSET), seed)


def rendered_pair(template: Any, query: str, doc: str) -> tuple[str, str]:
    """(query part, document part) of the family's template; their concatenation is the one
    text embedfleet scores (``ScoreTemplate.render`` with the default instruction)."""
    return (template.query.format(instruction=template.default_instruction, query=query),
            template.document.format(document=doc))


def rerank_body(model: str, query: str, docs: list[str], template: Any = None) -> dict[str, Any]:
    """The ``/v1/rerank`` body (fields both embedfleet and vLLM take). ``template``: send the
    pairs rendered (to vLLM, which does not apply embedfleet's family template)."""
    if template is not None:
        query, docs = rendered_pair(template, query, "")[0], [
            rendered_pair(template, query, d)[1] for d in docs]
    return {"model": model, "query": query, "documents": docs}


def scores_in_order(body: dict[str, Any], expected: int) -> list[float]:
    """The relevance scores of a ``/v1/rerank`` answer (sorted best first) in document order."""
    results = body["results"]
    if sorted(r["index"] for r in results) != list(range(expected)):
        raise ValueError(f"asked to rank {expected} documents, got indices "
                         f"{sorted(r['index'] for r in results)[:8]}...")
    return [float(r["relevance_score"]) for r in sorted(results, key=lambda r: r["index"])]


class HttpRerank:
    """``rerank`` over ``POST /v1/rerank`` for an ``OpenAIHttpPeer``."""

    template: Any = None

    async def rerank(self, query: str, docs: list[str]) -> list[float]:
        r = await self._client().post("/v1/rerank", json=rerank_body(  # type: ignore[attr-defined]
            self.model, query, docs, self.template))  # type: ignore[attr-defined]
        if r.status_code != 200:
            raise RuntimeError(f"{self.name}: HTTP {r.status_code}: "  # type: ignore
                               f"{r.text[:300]}")
        return scores_in_order(r.json(), len(docs))


class ServeReranker(HttpRerank, VllmServePeer):
    def __init__(self, template: Any, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.template = template


class EmbedfleetReranker(HttpRerank, EmbedfleetPeer):
    """Raw pairs: embedfleet renders its family's template itself."""

    async def start(self) -> None:
        try:
            await super().start()
        except RuntimeError:
            if self.started_cluster or self.models_entry is not None:
                raise
            raise RuntimeError(  # a cluster of its own config answers at the URL
                f"the cluster at {self.base_url} does not serve the reranker {self.model!r}: "
                "stop it (`embedfleet down`) so the bench starts one that does") from None


class InProcessReranker(VllmInProcessPeer):
    def __init__(self, template: Any, engine_kwargs: dict[str, Any]) -> None:
        super().__init__("vllm", engine_kwargs)
        self.template = template

    async def rerank(self, query: str, docs: list[str]) -> list[float]:
        self._seq += 1
        if self.template is not None:
            ids = self.engine.tokenize(["".join(rendered_pair(self.template, query, d))
                                        for d in docs])
        else:  # a cross-encoder: the tokenizer's own pair encoding, as embedfleet does
            ids = [list(x) for x in self.engine.hf_tokenizer([query] * len(docs),
                                                             docs)["input_ids"]]
        out = await self.engine.embed(ids, request_id=f"bench-rerank-{self._seq}")
        return [float(e.vector.reshape(-1)[0]) for e in out]


def rerank_config(base: Any, folder: Path, url: str,
                  canary: dict[str, str] | None = None) -> Any:
    """``base`` with one model: the reranker in ``folder``, on one card, one replica; ``canary``:
    its ordering canary's triple (None: the shipped one, which needs trained weights)."""
    from ..deployments.config.schema import config_to_data, parse_config

    data = config_to_data(base)
    data["models"] = [{
        "name": folder.name.lower(), "task": "rerank", "source": {"path": str(folder)},
        "max_model_len": MAX_MODEL_LEN,
        # a request is 32 pairs of up to ~400 tokens: one engine step holds a request or two
        "engine": {"max_num_batched_tokens": 8192, "kv_cache_memory_bytes": 1 << 26},
        "replicas": {"min_replicas": 1, "max_replicas": 1},
        **({"rerank": {"canary": canary}} if canary else {})}]
    return bench_config(parse_config(data, f"rerank bench ({folder})"), url)


def pair_tokens(tokenizer: Any, template: Any, requests: list[Request]) -> list[int]:
    """Tokens of each pair as every peer scores it (the same count for all)."""
    if template is not None:
        texts = ["".join(rendered_pair(template, q, d)) for q, docs in requests for d in docs]
        return [len(x) for x in tokenizer(texts)["input_ids"]]
    qs = [q for q, docs in requests for _ in docs]
    return [len(x) for x in tokenizer(qs, [d for _, docs in requests for d in docs])["input_ids"]]


def pair_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """The rerank workload's medians under their own names (``summary``: ``report.summarize``'s
    entry for ``rerank``)."""
    return {peer: {"repeats": s["repeats"], "pairs_per_s": s["texts_per_s"],
                   "cpu_s_per_1k_pairs": s["cpu_s_per_1k"],
                   "driver_cpu_s_per_1k_pairs": s["driver_cpu_s_per_1k"],
                   "p50_ms": s["p50_ms"], "p99_ms": s["p99_ms"]}
            for peer, s in summary.items()}


def score_agreement(scores: dict[str, Any], reference: str) -> dict[str, Any]:
    """{peer: {max_abs_delta, ok}} of each peer's probe scores against ``reference``'s."""
    ref = scores.get(reference)
    out: dict[str, Any] = {}
    for peer, s in scores.items():
        if isinstance(s, str) or isinstance(ref, str) or ref is None:
            out[peer] = {"max_abs_delta": None, "ok": False if isinstance(s, str) else None,
                         "note": s if isinstance(s, str) else f"no {reference} scores"}
            continue
        delta = max(abs(a - b) for a, b in zip(s, ref, strict=True))
        out[peer] = {"max_abs_delta": round(delta, 8), "ok": delta <= MAX_SCORE_DELTA}
    return out


async def _timed(peer: Any, wl: RerankWorkload, rep: int, tokens: int, conc: int,
                 meter: Any) -> dict[str, Any]:
    cpu_err: list[str] = []
    try:
        meter.start()
    except Exception as exc:  # noqa: BLE001 - measuring must never fail the run
        meter, cpu_err = None, [describe_error(exc)]
    try:
        lat, wall = await drive(lambda r: peer.rerank(*r), wl.requests, conc)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported per run
        lat, wall, error = [], 0.0, describe_error(exc)
    reading = None
    if meter is not None:
        try:
            reading = meter.stop()
        except Exception as exc:  # noqa: BLE001
            cpu_err.append(describe_error(exc))
    rec = rpt.run_record(repeat=rep, workload="rerank", peer=peer.name, latencies=lat,
                         seconds=wall, texts=wl.pairs, tokens=tokens, error=error, cpu=reading)
    if cpu_err:
        rec["cpu_error"] = cpu_err[0]
    return rec


async def run_rerank(args: argparse.Namespace, base: Any, out: Path, console: Any
                     ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """(run records, the workload's info, the report's ``rerank`` section)."""
    from transformers import AutoTokenizer

    from ..deployments.engine.rerank_models import family_for
    from .tiny_qwen3_reranker import build_tiny_qwen3_reranker, canary_triple

    folder = Path(args.rerank_model) if args.rerank_model else build_tiny_qwen3_reranker()
    fam = family_for([folder.name.lower(), str(folder)])
    # the built random-weight model orders only a triple fixed by its own reference scores
    canary = None if args.rerank_model or fam is None else canary_triple(folder, fam.template)
    cfg = rerank_config(base, folder.resolve(), args.embedfleet_url, canary)
    m = cfg.models[0]
    template = fam.template if fam else None
    wl = build_rerank(REQUESTS["quick" if args.quick else "full"], args.seed,
                      warmup=1 if args.quick else 4)
    lengths = sorted(pair_tokens(AutoTokenizer.from_pretrained(folder), template, wl.requests))
    if lengths[-1] > MAX_MODEL_LEN:
        raise RuntimeError(f"rerank: a pair has {lengths[-1]} tokens > {MAX_MODEL_LEN}")
    conc = args.concurrency
    info = {"description": f"one query (3-20 words) + {DOCS_PER_REQUEST} documents (5-250 "
            "tokens, log-uniform) a request, POST /v1/rerank", "unit": UNIT,
            "texts": wl.pairs, "tokens": sum(lengths), "tokens_min": lengths[0],
            "tokens_median": lengths[len(lengths) // 2], "tokens_max": lengths[-1],
            "seed": wl.seed, "texts_per_request": DOCS_PER_REQUEST, "concurrency": conc,
            "warmup_texts": sum(len(d) for _, d in wl.warmup), "probe_texts": DOCS_PER_REQUEST,
            "chunked": False, "params": {"model": m.name, "model_path": str(folder),
                                         "family": fam.name if fam else None}}
    section: dict[str, Any] = {"status": "ok", "model": m.name, "model_path": str(folder),
                               "family": fam.name if fam else None, "unit": UNIT,
                               "skipped": [], "peers": {}}
    if "infinity" in args.peer_list:
        section["skipped"].append({"peer": "infinity", "reason": "Infinity serves Qwen3-"
                                   "Reranker only from a converted checkpoint"})
    sub = out / "rerank"
    sub.mkdir(parents=True, exist_ok=True)
    peers: list[Any] = []
    runs: list[dict[str, Any]] = []
    scores: dict[str, Any] = {}
    try:
        prefix = False
        if "embedfleet" in args.peer_list:  # first: the vLLM peers take its prefix-cache choice
            ef = EmbedfleetReranker(args.embedfleet_url, m.name, conc + 2, cfg, sub,
                                    args.core_list)
            peers.append(ef)
            section["peers"].update(await start_peers([ef], console))
            prefix = bool(((ef.models_entry or {}).get("prefix_cache") or {}).get("enabled"))
        section["prefix_caching"] = prefix
        kw = cfg.engine_kwargs(m, enable_prefix_caching=prefix)
        makers = {"vllm": lambda: InProcessReranker(template, kw),
                  "vllm-serve": lambda: ServeReranker(template, kw, conc + 2, sub,
                                                      args.core_list)}
        others = [make() for name, make in makers.items() if name in args.peer_list]
        peers += others
        section["peers"].update(await start_peers(others, console) if others else {})
        active = [p for p in peers if section["peers"][p.name]["status"] == "ok"]
        for rep in range(args.repeats):
            order = active[rep % len(active):] + active[:rep % len(active)] if active else []
            for p in order:
                try:
                    await drive(lambda r, p=p: p.rerank(*r), wl.warmup[:1 if rep else None],
                                conc)
                except Exception as exc:  # noqa: BLE001 - this run's error
                    runs.append(rpt.run_record(repeat=rep, workload="rerank", peer=p.name,
                                               latencies=[], seconds=0, texts=wl.pairs,
                                               tokens=sum(lengths),
                                               error=f"warm-up: {describe_error(exc)}"))
                else:
                    runs.append(await _timed(p, wl, rep, sum(lengths), conc,
                                             cpu_meter(p, peers)))
                r = runs[-1]
                console.print(f"  rerank             {p.name:<10} #{rep + 1}: " + (
                    f"{r['texts_per_s']:8.1f} pairs/s  p50 {r['p50_ms']:8.1f} ms  CPU "
                    f"{r['cpu_s_per_1k']} s/1k pairs" if r["error"] is None
                    else f"[red]{r['error']}[/red]"))
                if rep == 0 and r["error"] is None:
                    try:
                        scores[p.name] = await p.rerank(*wl.requests[0])
                    except Exception as exc:  # noqa: BLE001
                        scores[p.name] = f"probe request failed: {describe_error(exc)}"
    except Exception as exc:  # noqa: BLE001 - reported, like a peer that failed
        section.update(status="failed", reason=f"{type(exc).__name__}: {exc}"[-2000:])
    finally:
        for p in peers:
            try:
                section["peers"].setdefault(p.name, {"status": "failed",
                                                     "reason": "interrupted"})
                section["peers"][p.name]["info"] = p.describe()
                await p.stop()
            except Exception as exc:  # noqa: BLE001 - stop the others regardless
                console.print(f"[red]{p.name}: stop failed: {exc}[/red]")
    reference = "vllm" if "vllm" in scores else "vllm-serve"
    section["correctness"] = {"reference": reference, "max_abs_delta": MAX_SCORE_DELTA,
                              "peers": score_agreement(scores, reference)}
    section["summary"] = pair_summary(rpt.summarize(runs).get("rerank", {}))
    return runs, info, section
