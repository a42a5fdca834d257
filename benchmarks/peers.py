"""The systems `embedfleet bench` compares, behind one small protocol: start, embed, stop.

* ``vllm``        bare vLLM ``AsyncLLM`` in this process (``VllmEmbeddingEngine``): the engine's
                  limit, with no HTTP, no serialisation, no router.
* ``vllm-serve``  vLLM's own OpenAI server as a subprocess, started with the same engine arguments
                  (flags derived from the same ``engine_kwargs`` dict, never retyped).
* ``infinity``    Infinity (``infinity-emb``) from its own venv, serving the same weights.
* ``embedfleet``  lives in ``benchmarks/embedfleet_peer.py`` (it may start a whole cluster).

Every peer returns one float32 vector per text, so the harness can check that all peers compute
the same thing before it compares how fast they do it.
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from embedfleet.benchmarks.workloads import Workload

ROOT = Path(__file__).resolve().parent.parent
INFINITY_VENV = ROOT / ".venv-infinity"
VLLM_SERVE_PORT = 8101
INFINITY_PORT = 7997
START_TIMEOUT_S = 900  # a cold vLLM start on 2 busy cores takes minutes
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


def cpu_env(cores: list[int]) -> dict[str, str]:
    """vLLM CPU thread binding, as an embedfleet replica sets it (deployments/engine/platform.py)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


# -- bare vLLM ---------------------------------------------------------------------------------
class VllmInProcessPeer:
    """``VllmEmbeddingEngine`` with the config's engine kwargs, as benchmarks/throughput.py uses it.

    For the ``long`` workload it plans windows with embedfleet's own long-input code
    (``embedfleet.deployments.request_path.long_input.plan``/``merge_planned``) and the model's config policy in ``chunk``
    mode, so its vectors must equal embedfleet's; it is the engine-limit reference there.
    """

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
        from embedfleet.deployments.engine.vllm_engine import VllmEmbeddingEngine
        from embedfleet.deployments.request_path.long_input import SpecialTokens

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
        from embedfleet.deployments.request_path.long_input import flatten, merge_planned

        out = await self.engine.embed(flatten(plans), request_id=rid)
        return merge_planned(plans, [e.vector for e in out], self.engine.info.normalizes)

    async def stop(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

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
    from embedfleet.deployments.request_path.long_input import plan

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
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


class ServerProcess:
    """One server subprocess in its own process group (so its children go with it), logging to a
    file; never adopts a server that someone else left on the port."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path, port: int,
                 cores: list[int] | None = None):
        self.name, self.cmd, self.env, self.log, self.port = name, cmd, env, log, port
        self.cores = cores
        self.proc: subprocess.Popen | None = None

    def launch(self) -> None:
        if port_in_use(self.port):
            raise PeerUnavailable(f"port {self.port} is already in use; {self.name} needs it "
                                  "free (the harness never benchmarks a server it did not start)")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        cores = self.cores
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)

    async def wait_healthy(self, url: str, timeout_s: float = START_TIMEOUT_S) -> float:
        """Seconds until ``url`` answers 200; raises with the log's tail if the process dies."""
        import httpx

        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=5) as client:
            while time.monotonic() - t0 < timeout_s:
                if self.proc is None or self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited ({self.proc and self.proc.returncode})"
                                       f" while starting: {self.last_error()}\n{self.tail()}")
                try:
                    if (await client.get(url)).status_code == 200:
                        return time.monotonic() - t0
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(1)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s:.0f} s:\n{self.tail()}")

    def last_error(self) -> str:
        """The log's last line that names an error: the headline of a failed start."""
        lines = [ln.strip() for ln in self.tail(200).splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error" in ln.lower() or "exception" in ln.lower()]
        return (errors or lines or ["(empty log)"])[-1][:300]

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def terminate(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)  # our own child's group, by id
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def serve_flags(engine_kwargs: dict[str, Any]) -> list[str]:
    """vLLM CLI flags for ``AsyncEngineArgs(**engine_kwargs)``: ``foo_bar=x`` -> ``--foo-bar x``,
    booleans as ``--foo``/``--no-foo``. Every vLLM engine argument has a flag of that shape."""
    flags: list[str] = []
    for key, value in engine_kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags


class ServerPeer(OpenAIHttpPeer):
    """An HTTP peer whose server is a subprocess this harness starts, times and stops."""

    kind = "server (subprocess)"
    server: ServerProcess

    def __init__(self, name: str, base_url: str, model: str, concurrency: int):
        super().__init__(name, base_url, model, concurrency)
        self.startup_s: float | None = None

    def unavailable_reason(self) -> str | None:
        """Why this peer cannot run on this machine (None: it can)."""
        return None

    async def start(self) -> None:
        if reason := self.unavailable_reason():
            raise PeerUnavailable(reason)
        self.server.launch()
        self.startup_s = await self.server.wait_healthy(f"{self.base_url}/health")

    async def stop(self) -> None:
        await self.close_client()
        self.server.terminate()

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "command": self.server.cmd, "url": self.base_url,
                "startup_s": self.startup_s, "log": str(self.server.log)}


class VllmServePeer(ServerPeer):
    """`python -m vllm.entrypoints.openai.api_server` with the same engine arguments as ``vllm``."""

    kind = "vLLM OpenAI server (subprocess)"

    def __init__(self, engine_kwargs: dict[str, Any], concurrency: int, log_dir: Path,
                 cores: list[int] | None, port: int = VLLM_SERVE_PORT):
        super().__init__("vllm-serve", f"http://127.0.0.1:{port}",
                         engine_kwargs["served_model_name"], concurrency)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               *serve_flags(engine_kwargs), "--host", "127.0.0.1", "--port", str(port)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **(cpu_env(cores) if cores else {})}
        self.server = ServerProcess("vllm-serve", cmd, env, log_dir / "vllm-serve.log", port)


def infinity_version(venv: Path = INFINITY_VENV) -> str | None:
    try:
        out = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import importlib.metadata as m; print(m.version('infinity-emb'))"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


class InfinityPeer(ServerPeer):
    """Infinity from .venv-infinity (benchmarks/setup_infinity_venv.sh), on the same weights folder
    as the vLLM peers, fp32 eager torch, pinned to the same cores."""

    kind = "Infinity server (subprocess, own venv)"

    def __init__(self, engine_kwargs: dict[str, Any], concurrency: int, log_dir: Path,
                 cores: list[int] | None, venv: Path = INFINITY_VENV, port: int = INFINITY_PORT,
                 batch_size: int = 32):
        super().__init__("infinity", f"http://127.0.0.1:{port}",
                         engine_kwargs["served_model_name"], concurrency)
        self.venv = venv
        # The command benchmarks/setup_infinity_venv.sh prints (see its comments for each flag),
        # without --lengths-via-tokenize: that makes Infinity tokenize every request once more
        # only to fill usage.prompt_tokens, which the harness does not read (it counts tokens
        # itself, the same count for every peer), so it would only slow Infinity down.
        cmd = [str(venv / "bin" / "infinity_emb"), "v2", "--model-id", engine_kwargs["model"],
               "--served-model-name", self.model, "--engine", "torch", "--device", "cpu",
               "--dtype", engine_kwargs["dtype"], "--batch-size", str(batch_size),
               "--pooling-method", "mean", "--no-bettertransformer", "--no-compile",
               "--no-trust-remote-code", "--url-prefix", "/v1",
               "--host", "127.0.0.1", "--port", str(port)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0"}
        if cores:
            env["OMP_NUM_THREADS"] = str(len(cores))
        self.server = ServerProcess("infinity", cmd, env, log_dir / "infinity.log", port, cores)

    def unavailable_reason(self) -> str | None:
        if not (self.venv / "bin" / "infinity_emb").exists():
            return f"{self.venv} has no infinity_emb: run `make bench-setup`"
        return None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "version": infinity_version(self.venv)}
