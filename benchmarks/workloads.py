"""Seeded workloads of `embedfleet bench`: what every peer is asked to embed.

Texts are built from words that are one token each in the bundled MiniLM (BERT uncased)
vocabulary, which the tiny Qwen3 model borrows too, so a text of ``k`` words is exactly ``k + 2``
tokens ([CLS] ... [SEP]). That lets a workload hit token lengths precisely (the mixed
distribution, a shared prefix that still fits a 256-token model) without loading a tokenizer
here; the harness still counts every workload's tokens with the model's own tokenizer, and that
count is the one reported (the same for every peer).

Everything is a pure function of (name, size, seed): the same call gives the same texts on every
machine, for every peer and every repeat. Warm-up texts come from a different seed, so a cache
(vLLM's prefix cache, or any response cache) cannot have seen the measured texts during warm-up.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

# One token each in MiniLM's vocab.txt (tests/test_bench_unit.py checks it against the file).
WORDS = tuple("""
the of and to in is was for on that with as by at from his it an were are which this be has or
had first one their its new after but who not they have her she two been other when there all
during into school time may years more most only over city some world would where later up such
used many can state about national out known university united then made three year team film
league also area part de since both american south north century people well high while season
under long number following several second early until between before group through series
including however game government family like war party day life because against back among
around end local being way last found took music large best small place these county water system
history public district main human general named major court service work home little same great
power members form country church right data light model field order point free head open market
process space value price rate level story report study plan design project result change policy
course theory energy growth health science research""".split())
SPECIAL_TOKENS = 2  # [CLS] and [SEP] around every text
WARMUP_SEED_OFFSET = 10_000

NAMES = ("short", "mixed", "shared-instruction", "long", "online", "router-overhead")
"""The workloads every MiniLM peer runs, in run order (`prefix-cache` is separate: causal model)."""
ONLINE_CONCURRENCY = 16
"""Online traffic: one text per request, this many requests in flight."""


@dataclass(frozen=True)
class Sizes:
    """How many texts each workload has, full run vs ``--quick``."""

    short: int = 2000
    mixed: int = 1000
    shared_instruction: int = 256
    long: int = 16
    long_tokens: tuple[int, int] = (2000, 6000)
    online: int = 1000
    router_overhead: int = 300  # requests of one text, one at a time: enough for a stable p50
    warmup_requests: int = 4
    probe_texts: int = 8  # texts per workload whose vectors are compared across peers

    def count(self, name: str) -> int:
        return {"short": self.short, "mixed": self.mixed, "shared-instruction":
                self.shared_instruction, "long": self.long,
                "prefix-cache": self.shared_instruction, "online": self.online,
                "router-overhead": self.router_overhead}[name]


FULL = Sizes()
# --quick: enough to exercise every peer end to end (a couple of requests per run), not to measure.
# Kept small because it runs in `make test` on two cores beside the session cluster.
QUICK = Sizes(short=32, mixed=32, shared_instruction=8, long=2, long_tokens=(600, 1200),
              online=32, router_overhead=8, warmup_requests=1, probe_texts=4)


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    texts: list[str]
    warmup: list[str]
    seed: int
    params: dict[str, Any] = field(default_factory=dict)
    chunked: bool = False
    """Documents longer than the model: embedfleet chunks them, bare vLLM gets them pre-chunked."""
    batch: int | None = None
    """Texts per request for this workload; None = the harness's ``--batch``."""
    concurrency: int | None = None
    """Requests in flight for this workload; None = the harness's ``--concurrency``."""

    @property
    def probe(self) -> list[str]:
        """The texts whose vectors every peer must agree on (set by ``build``)."""
        return self.texts[: self.params.get("probe_texts", 4)]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def short_queries(n: int, seed: int) -> list[str]:
    """Search-style queries of 3-20 words."""
    rng = random.Random(seed)
    return [_words(rng, rng.randint(3, 20)) for _ in range(n)]


def mixed_documents(n: int, seed: int, lo: int = 5, hi: int = 250) -> list[str]:
    """Documents whose token lengths (special tokens included) are log-uniform in [lo, hi]:
    many short ones and a long tail, as in real corpora."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tokens = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        out.append(_words(rng, max(1, tokens - SPECIAL_TOKENS)))
    return out


def instruction_prefix(tokens: int, seed: int = 7) -> str:
    """One long instruction shared by every text of the prefix-cache workload (``tokens`` words,
    each one token). It starts like Qwen3-Embedding's query instruction."""
    head = ("instruction given a web search query retrieve relevant passages that answer the "
            "query").split()
    rng = random.Random(seed)
    body = [rng.choice(WORDS) for _ in range(max(0, tokens - len(head)))]
    return " ".join((head + body)[:tokens])


def shared_instruction(n: int, seed: int, prefix_tokens: int, max_query_words: int = 20
                       ) -> list[str]:
    """The shared instruction prefix + a short distinct query (3..max_query_words words)."""
    prefix = instruction_prefix(prefix_tokens)
    rng = random.Random(seed)
    return [f"{prefix} query {_words(rng, rng.randint(3, max_query_words))}" for _ in range(n)]


def long_documents(n: int, seed: int, lo: int, hi: int) -> list[str]:
    """Documents of lo..hi tokens (uniform), far over a 256-token model: the chunking case."""
    rng = random.Random(seed)
    return [_words(rng, rng.randint(lo, hi) - SPECIAL_TOKENS) for _ in range(n)]


def shared_prefix_tokens(max_len: int, target: int, max_query_words: int = 20) -> int:
    """Prefix length (words = tokens) so that prefix + ``query`` + longest query + specials fits
    ``max_len``, capped at ``target``."""
    return max(1, min(target, max_len - SPECIAL_TOKENS - 1 - max_query_words))


def build(name: str, sizes: Sizes, *, max_len: int, batch: int = 32, seed: int = 0,
          shared_prefix_target: int = 768) -> Workload:
    """One workload for a model of ``max_len`` tokens.

    ``shared-instruction`` (and ``prefix-cache``, the same texts for the causal model) aims for a
    ``shared_prefix_target``-token instruction; on a 256-token model it is cut so every text
    still fits (no peer may truncate, or the peers would embed different inputs).
    """
    n = sizes.count(name)
    warm = sizes.warmup_requests * batch  # warm-up texts: full requests of the run's batch size
    common = {"probe_texts": sizes.probe_texts}
    if name in ("online", "router-overhead"):
        # The short workload's queries (same seed: the same texts), one per request; online
        # traffic with 16 in flight, or one at a time for the per-request latency of each hop.
        # Warm-up: at least one request per connection the run will hold open.
        conc = ONLINE_CONCURRENCY if name == "online" else 1
        what = (f"short queries, 3-20 words, 1 per request, {conc} in flight (online traffic)"
                if name == "online" else
                "short queries, 3-20 words, 1 per request, 1 in flight (per-request latency)")
        return Workload(name, what, short_queries(n, seed),
                        short_queries(max(sizes.warmup_requests, conc), seed + WARMUP_SEED_OFFSET),
                        seed, {**common, "words": [3, 20]}, batch=1, concurrency=conc)
    if name == "short":
        return Workload(name, "short queries, 3-20 words", short_queries(n, seed),
                        short_queries(warm, seed + WARMUP_SEED_OFFSET), seed,
                        {**common, "words": [3, 20]})
    if name == "mixed":
        return Workload(name, "documents, tokens log-uniform in 5-250", mixed_documents(n, seed),
                        mixed_documents(warm, seed + WARMUP_SEED_OFFSET), seed,
                        {**common, "tokens": [5, 250], "distribution": "log-uniform"})
    if name in ("shared-instruction", "prefix-cache"):
        prefix = shared_prefix_tokens(max_len, shared_prefix_target)
        return Workload(
            name, f"one {prefix}-token shared instruction + a distinct 3-20-word query",
            shared_instruction(n, seed, prefix),
            # the same instruction with other queries: warm-up may cache the instruction (as in
            # production, where it is always hot), never a measured text
            shared_instruction(warm, seed + WARMUP_SEED_OFFSET, prefix),
            seed, {**common, "prefix_tokens": prefix, "query_words": [3, 20],
                   "prefix_target": shared_prefix_target, "max_len": max_len})
    if name == "long":
        lo, hi = sizes.long_tokens
        return Workload(name, f"documents of {lo}-{hi} tokens, chunked into model-sized windows",
                        long_documents(n, seed, lo, hi),
                        long_documents(1, seed + WARMUP_SEED_OFFSET, lo, lo), seed,
                        {**common, "probe_texts": min(2, n), "tokens": [lo, hi]},
                        chunked=True, batch=1)
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(NAMES + ('prefix-cache',))}")


def batches(texts: list[str], size: int) -> list[list[str]]:
    if size < 1:
        raise ValueError(f"batch size must be >= 1, got {size}")
    return [texts[i:i + size] for i in range(0, len(texts), size)]
