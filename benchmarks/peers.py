"""The systems `embedfleet bench` compares, behind one small protocol: start, embed, stop.

* ``vllm``        bare vLLM ``AsyncLLM`` in this process (``VllmEmbeddingEngine``): the engine's
                  limit, with no HTTP, no serialisation, no router.
* ``vllm-serve``, ``infinity``  server subprocesses: ``benchmarks/server_peers.py``.
* ``embedfleet``  lives in ``benchmarks/embedfleet_peer.py`` (it may start a whole cluster).

Here: the protocol, the in-process ``vllm`` peer, and the OpenAI-compatible HTTP client every
other peer is built on.

Every peer returns one float32 vector per text, so the harness can check that all peers compute
the same thing before it compares how fast they do it.
"""

from __future__ import annotations

import base64
import os
import socket
from typing import Any, Protocol

import numpy as np

from .workloads import Workload

REQUEST_TIMEOUT_S = 900
NO_CHUNKING = ("no chunking: documents longer than the model's context would be rejected or "
               "truncated, so its vectors would not be comparable; bare vLLM with embedfleet's "
               "windows is the engine-limit reference")


class PeerUnavailable(RuntimeError):
    """The peer cannot run here (not installed, port taken); the message says what to do."""


class Peer(Protocol):
    name: str

    def skip_reason(self, workload: Workload) -> str | None:
        """Why this peer does not run ``workload`` (None = it does)."""

    async def start(self) -> None: ...

    async def embed(self, texts: list[str], workload: Workload) -> list[np.ndarray]:
        """One vector per text, in order."""

    async def stop(self) -> None: ...

    def describe(self) -> dict[str, Any]:
        """What the report should say about this peer (command, versions, settings)."""

    def cpu_scope(self, others: list[Any]) -> Any:
        """The processes whose CPU is this peer's (a ``process_cpu`` scope); ``others``: the
        other peers, whose processes must not be counted as this one's."""


def cpu_env(cores: list[int]) -> dict[str, str]:
    """vLLM CPU thread binding and the engine's malloc, as an embedfleet replica sets them
    (deployments/engine/platform.py): every peer's engine runs on the same allocator."""
    from ..deployments.engine.platform import engine_ld_preload

    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "LD_PRELOAD": engine_ld_preload()}


# -- bare vLLM ---------------------------------------------------------------------------------
class VllmInProcessPeer:
    """``VllmEmbeddingEngine`` with the config's engine kwargs, as benchmarks/throughput.py uses it.

    For the ``long`` workload it plans windows with embedfleet's own long-input code
    (``embedfleet.deployments.common.long_input.plan``/``merge_planned``) and the model's config policy in ``chunk``
    mode, so its vectors must equal embedfleet's; it is the engine-limit reference there.
    """

    in_process = True  # the load driver shares this peer's process: no separate driver figure

    def __init__(self, name: str, engine_kwargs: dict[str, Any], long_policy: Any = None):
        self.name = name
        self.engine_kwargs = engine_kwargs
        self.long_policy = long_policy
        self.engine: Any = None
        self._special: Any = None
        self._seq = 0

    def skip_reason(self, workload: Workload) -> str | None:
        return None

    async def start(self) -> None:
        from ..deployments.engine.vllm_engine import VllmEmbeddingEngine
        from ..deployments.common.long_input import SpecialTokens

        # bare: vLLM's own stat loggers (engine_counters reads them), no embedfleet probes
        self.engine = VllmEmbeddingEngine(dict(self.engine_kwargs), observed=False)
        self._special = SpecialTokens.from_tokenizer(self.engine.hf_tokenizer)

    async def embed(self, texts: list[str], workload: Workload) -> list[np.ndarray]:
        self._seq += 1
        ids = self.engine.tokenize(texts)
        rid = f"bench-{self.name}-{self._seq}"
        if not workload.chunked:
            return [e.vector for e in await self.engine.embed(ids, request_id=rid)]
        plans = prechunk(ids, self.engine.info.max_model_len, self.long_policy, self._special)
        from ..deployments.common.long_input import flatten, merge_planned

        out = await self.engine.embed(flatten(plans), request_id=rid)
        return merge_planned(plans, [e.vector for e in out], self.engine.info.normalizes)

    async def stop(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def cpu_scope(self, others: list[Any]) -> Any:
        """This process (AsyncLLM's front end: tokenising, output handling; and the load driver,
        which cannot be split from it) with its descendants (vLLM's engine core and workers),
        without the subtrees of the server peers it started (``vllm serve``, Infinity)."""
        from .process_cpu import ProcessTree

        def servers() -> list[int]:
            return [pid for o in others if (pid := getattr(o, "server_pid", lambda: None)())]

        return ProcessTree(lambda: [os.getpid()], "bench process (AsyncLLM front end + load "
                           "driver)", exclude=servers,
                           what="this (bench) process - AsyncLLM's front end and the in-process "
                                "load driver - and its descendants (vLLM engine core, workers), "
                                "without the server peers' subtrees")

    def describe(self) -> dict[str, Any]:
        info = self.engine.info if self.engine else None
        return {"kind": "vLLM AsyncLLM in-process", "engine_kwargs": self.engine_kwargs,
                "engine": info.engine_version if info else None,
                "prefix_caching": info.prefix_caching if info else None}

    def engine_counters(self) -> dict[str, float]:
        """vLLM's own cumulative request metrics (its Prometheus stat logger, read in-process):
        queue, prefill and end-to-end time, prompt and prefix-cached tokens. Diff two readings to
        get one run's numbers. Empty when this vLLM keeps them elsewhere."""
        try:
            loggers = self.engine._llm.logger_manager.stat_loggers
        except AttributeError:
            return {}
        totals: dict[str, float] = {}
        for lg in loggers:
            # vLLM unregisters older engines' collectors from the global registry when a new
            # engine starts, so read this engine's own collector objects, not the registry.
            for metric in vars(lg).values():
                # per-engine metrics are dicts {engine index: labelled child}
                for m in (metric.values() if isinstance(metric, dict) else [metric]):
                    if not hasattr(m, "collect") or not str(getattr(m, "_name", "")).startswith(
                            "vllm:"):
                        continue
                    for fam in m.collect():
                        for s in fam.samples:
                            if s.name.endswith(("_sum", "_count", "_total")):
                                totals[s.name] = totals.get(s.name, 0.0) + float(s.value)
        return totals


def prechunk(token_ids: list[list[int]], max_len: int, policy: Any, special: Any) -> list[Any]:
    """embedfleet's chunk plan for each tokenised document (``policy`` forced to ``chunk``)."""
    from ..deployments.common.long_input import plan

    chunking = policy.model_copy(update={"mode": "chunk"})
    return [plan(ids, max_len, chunking, special, what=f"input[{i}]")
            for i, ids in enumerate(token_ids)]


# -- OpenAI-compatible HTTP peers ---------------------------------------------------------------
def decode_embeddings(body: dict[str, Any], expected: int) -> list[np.ndarray]:
    """The vectors of an OpenAI embeddings response, in input order (base64 or float lists)."""
    data = sorted(body["data"], key=lambda d: d["index"])
    if len(data) != expected:
        raise ValueError(f"asked for {expected} embeddings, got {len(data)}")
    out = []
    for d in data:
        emb = d["embedding"]
        out.append(np.frombuffer(base64.b64decode(emb), dtype="<f4").copy()
                   if isinstance(emb, str) else np.asarray(emb, dtype=np.float32))
    return out


def embeddings_body(model: str, texts: list[str], **extra: Any) -> dict[str, Any]:
    """Same body for every HTTP peer: base64 vectors (4 bytes a float, not ~20 chars of JSON)."""
    return {"model": model, "input": texts, "encoding_format": "base64", **extra}


class OpenAIHttpPeer:
    """POST /v1/embeddings to ``base_url``; subclasses start and stop the server."""

    def __init__(self, name: str, base_url: str, model: str, concurrency: int):
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.concurrency = concurrency
        self.client: Any = None

    def skip_reason(self, workload: Workload) -> str | None:
        return NO_CHUNKING if workload.chunked else None

    def _client(self) -> Any:
        import httpx

        if self.client is None:
            limits = httpx.Limits(max_connections=self.concurrency + 2,
                                  max_keepalive_connections=self.concurrency + 2)
            self.client = httpx.AsyncClient(base_url=self.base_url, timeout=REQUEST_TIMEOUT_S,
                                            limits=limits)
        return self.client

    def request_extra(self, workload: Workload) -> dict[str, Any]:
        return {}

    async def embed(self, texts: list[str], workload: Workload) -> list[np.ndarray]:
        r = await self._client().post("/v1/embeddings", json=embeddings_body(
            self.model, texts, **self.request_extra(workload)))
        if r.status_code != 200:
            raise RuntimeError(f"{self.name}: HTTP {r.status_code}: {r.text[:300]}")
        return decode_embeddings(r.json(), len(texts))

    async def close_client(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts connections on ``host:port`` (a server peer's, a Ray head's)."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0
