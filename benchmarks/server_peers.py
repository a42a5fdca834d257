"""The bench peers that run as a server subprocess this harness starts, times and stops.

* ``vllm-serve``  vLLM's own OpenAI server, started with the same engine arguments as the
                  in-process ``vllm`` peer (flags derived from the same ``engine_kwargs`` dict,
                  never retyped).
* ``infinity``    Infinity (``infinity-emb``) from its own venv, serving the same weights.

Both speak the OpenAI embeddings API (``peers.OpenAIHttpPeer``); each server runs in its own
process group, logs to a file, and is never adopted when someone else left one on the port.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .peers import OpenAIHttpPeer, PeerUnavailable, cpu_env, port_in_use
from ..deployments.engine.vllm_api import engine_process_env

ROOT = Path(__file__).resolve().parent.parent
INFINITY_VENV = ROOT / ".venv-infinity"
VLLM_SERVE_PORT = 8101
INFINITY_PORT = 7997
START_TIMEOUT_S = 900  # a cold vLLM start on 2 busy cores takes minutes


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
    booleans as ``--foo``/``--no-foo``, dicts and lists (``hf_overrides``) as JSON, which is
    what vLLM's CLI parses them from. Every vLLM engine argument has a flag of that shape."""
    flags: list[str] = []
    for key, value in engine_kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value)]
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

    def server_pid(self) -> int | None:
        return self.server.proc.pid if self.server.proc is not None else None

    def cpu_scope(self, others: list[Any]) -> Any:
        """The server subprocess and all its descendants (vLLM's engine core and workers, or
        Infinity's); the load driver is in the bench process, measured apart."""
        from .process_cpu import ProcessTree

        return ProcessTree(lambda: [pid] if (pid := self.server_pid()) else [],
                           f"{self.name} server", what=f"the {self.name} server subprocess "
                           "and all its descendants")

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
        # the same engine as the other peers: what the engine arguments need of the environment
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **engine_process_env(engine_kwargs),
               **(cpu_env(cores) if cores else {})}
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
