"""vLLM's import must not close handlers the process already has (Serve's replica log handler).

Without ``VLLM_CONFIGURE_LOGGING=0`` vLLM runs ``logging.config.dictConfig`` (at import in 0.23, when
the engine starts in 0.32), which closes
every existing handler; Serve's ``MemoryHandler`` then has no target, and a restarted Serve
controller cannot recover the engine replicas (``is_allocated`` reads the handler's file) and
replaces them all. The replicas get the variable from the rendered runtime env.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from embedfleet.deployments.config.ray_options import RUNTIME_ENV_VARS

# What Serve's component logger leaves in a replica before user code imports vLLM.
PROBE = """
import logging, logging.handlers, tempfile
target = logging.FileHandler(tempfile.mktemp())
memory = logging.handlers.MemoryHandler(100, target=target)
logging.getLogger("ray.serve").addHandler(memory)
import vllm.logger  # vLLM 0.23 (the Ascend stack) configures logging here, at import
try:  # vLLM 0.32 does it when AsyncLLM starts (v1/engine/async_llm.py), the same way
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging_if_needed
    configure_logging_if_needed(LoggingConfig())
except ImportError:
    pass
print("target-kept" if memory.target is not None else "target-closed")
"""


def _probes(*extra_envs: dict[str, str]) -> list[str]:
    """What each probe printed; the probes run side by side (each imports vLLM: ~15 s)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "VLLM_CONFIGURE_LOGGING"}
    procs = [subprocess.Popen([sys.executable, "-c", PROBE], env={**env, **extra},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for extra in extra_envs]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-2000:]
        out.append(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.engine  # two fresh processes start vLLM: the `engine` tier, not `make test-unit`
def test_the_replicas_runtime_env_keeps_serves_log_handler_through_vllms_start():
    shipped, without = _probes(dict(RUNTIME_ENV_VARS), {})
    assert shipped == "target-kept"
    # ... and the failure the variable prevents is real in the vLLM installed here.
    assert without == "target-closed"
