"""Throughput: embedfleet over HTTP vs. bare vLLM in-process, on the same texts and batching.

    python -m embedfleet.benchmarks.throughput --mode vllm          # the engine's own limit (no cluster)
    python -m embedfleet.benchmarks.throughput --mode http          # against a running `embedfleet up`
    python -m embedfleet.benchmarks.throughput --mode both          # vllm first, then http (cluster up)
    python -m embedfleet.benchmarks.throughput --mode long --model tiny-qwen3   # 32K-token inputs, chunked,
                                                                     # vs short inputs, over HTTP

A seeded workload of mixed-length texts is sent in fixed batches with fixed concurrency; warm-up is
excluded; each mode reports texts/s, tokens/s and p50/p99 batch latency, as JSON under
benchmarks/results/. Run the two modes on an otherwise idle machine: on CPU they compete for the
same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega embedding vector cluster replica card engine "
         "token batch latency throughput model prefix cache router").split()


def workload(n: int, seed: int = 0, min_words: int = 5, max_words: int = 150) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
            for _ in range(n)]


def summarize(name: str, latencies: list[float], wall: float, texts: int,
              tokens: int) -> dict[str, Any]:
    lat = sorted(latencies)
    return {"name": name, "texts": texts, "tokens": tokens, "seconds": round(wall, 3),
            "texts_per_s": round(texts / wall, 1), "tokens_per_s": round(tokens / wall, 1),
            "p50_ms": round(1000 * statistics.median(lat), 1),
            "p99_ms": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1)}


async def _drive(batches: list[list[str]], concurrency: int, send) -> tuple[list[float], float,
                                                                            int]:
    """embedfleet.benchmarks.load_driver.drive, also summing the token counts ``send`` returns."""
    from .load_driver import drive

    tokens = 0

    async def counted(b: list[str]) -> None:
        nonlocal tokens
        tokens += await send(b)

    latencies, wall = await drive(counted, batches, concurrency)
    return latencies, wall, tokens


async def run_vllm(texts: list[str], batch: int, concurrency: int, config: str | None) -> dict:
    from ..deployments.config.schema import load_config
    from ..deployments.engine.vllm_engine import VllmEmbeddingEngine

    cfg = load_config(config)
    m = cfg.models[0]
    engine = VllmEmbeddingEngine(cfg.engine_kwargs(m, enable_prefix_caching=False), observed=False)
    try:
        async def send(b: list[str]) -> int:
            ids = engine.tokenize(b)
            await engine.embed(ids, request_id=f"bench-{time.perf_counter_ns()}")
            return sum(len(i) for i in ids)

        batches = [texts[i:i + batch] for i in range(0, len(texts), batch)]
        await _drive(batches[:4], concurrency, send)  # warm-up
        lat, wall, tokens = await _drive(batches, concurrency, send)
        return summarize("vllm-in-process", lat, wall, len(texts), tokens)
    finally:
        engine.shutdown()


async def run_http(texts: list[str], batch: int, concurrency: int, url: str, model: str) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def send(b: list[str]) -> int:
            r = await client.post("/v1/embeddings", json={"model": model, "input": b,
                                                          "encoding_format": "base64"})
            r.raise_for_status()
            return r.json()["usage"]["prompt_tokens"]

        batches = [texts[i:i + batch] for i in range(0, len(texts), batch)]
        await _drive(batches[:4], concurrency, send)
        lat, wall, tokens = await _drive(batches, concurrency, send)
        return summarize("embedfleet-http", lat, wall, len(texts), tokens)


async def run_long(url: str, model: str, n_long: int, long_tokens: int,
                   concurrency: int) -> list[dict]:
    """Tokens/s on long documents embedded with `long_input: chunk` vs on short inputs."""
    import httpx

    rng = random.Random(1)
    # words that are one token each in BERT-style vocabularies, so a document is long_tokens
    # tokens with [CLS]/[SEP]
    single = "the court law case party claim time year day order state act".split()
    long_docs = [" ".join(rng.choice(single) for _ in range(long_tokens - 2))
                 for _ in range(n_long)]
    short = workload(n_long * 64, seed=2, min_words=5, max_words=40)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def send(b: list[str], chunk: bool) -> int:
            body = {"model": model, "input": b, "encoding_format": "base64"}
            if chunk:
                body["long_input"] = "chunk"
            r = await client.post("/v1/embeddings", json=body)
            r.raise_for_status()
            return r.json()["usage"]["prompt_tokens"]

        runs = []
        for name, batches, chunk in (
                ("long-32k-chunked", [[d] for d in long_docs], True),
                ("short-inputs", [short[i:i + 32] for i in range(0, len(short), 32)], False)):
            await _drive(batches[:1], 1, lambda b, c=chunk: send(b, c))  # warm-up
            lat, wall, tokens = await _drive(batches, concurrency,
                                             lambda b, c=chunk: send(b, c))
            texts = sum(len(b) for b in batches)
            runs.append(summarize(name, lat, wall, texts, tokens))
        return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", choices=("vllm", "http", "both", "long"), default="both")
    p.add_argument("--long-docs", type=int, default=4, help="long mode: documents to embed")
    p.add_argument("--long-tokens", type=int, default=32768, help="long mode: tokens each")
    p.add_argument("--texts", type=int, default=2000)
    p.add_argument("--texts-file", type=Path, help="JSONL with a `text` field (e.g. the input of "
                   "`embedfleet embed-corpus`): the engine's limit on a corpus's own texts")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--config", help="embedfleet config whose first model the vllm mode loads")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="all-minilm-l6-v2")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ..deployments.engine.platform import engine_ld_preload

    # the bare engine's core (spawned) on the malloc an embedfleet replica gives its engine
    os.environ["LD_PRELOAD"] = engine_ld_preload()
    texts = ([json.loads(line)["text"] for line in args.texts_file.open() if line.strip()]
             if args.texts_file else workload(args.texts))
    runs = []
    if args.mode in ("vllm", "both"):
        runs.append(asyncio.run(run_vllm(texts, args.batch, args.concurrency, args.config)))
    if args.mode == "long":
        runs += asyncio.run(run_long(args.url, args.model, args.long_docs, args.long_tokens,
                                     args.concurrency))
    if args.mode in ("http", "both"):
        runs.append(asyncio.run(run_http(texts, args.batch, args.concurrency, args.url,
                                         args.model)))
    report = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version()},
              "workload": {"texts": len(texts), "file": str(args.texts_file or ""),
                           "batch": args.batch,
                           "concurrency": args.concurrency, "words": [5, 150], "seed": 0},
              "runs": runs}
    if args.mode == "both":
        report["http_over_vllm"] = round(runs[1]["texts_per_s"] / runs[0]["texts_per_s"], 3)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"throughput-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
