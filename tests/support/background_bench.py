"""`embedfleet bench --quick` as a background run of the test session.

The bench smoke test (tests/test_e2e_bench_quick.py) spent 2 to 5 minutes of `make test`,
mostly starting its two vLLM peers, with no request to embedfleet. tests/conftest.py starts it
with the first cluster tests, beside tests that mostly wait (for Serve's timers, for cold starts
that keep one core busy), and makes the later cluster tests wait for it; the test checks what it
wrote.

Its own module, so tests/conftest.py (which pytest imports as ``conftest``) and the test (which
imports ``tests....``) share one instance.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

# Not vllm-serve: its server is a third vLLM start (API server, engine core, worker) beside a
# busy session cluster. In a rehearsal on a starved machine it took 6+ minutes to come up while
# the later cluster tests waited for the bench. `embedfleet bench` runs it.
PEERS = ("vllm", "embedfleet")
WORKLOADS = ("short", "online")


class BackgroundBench:
    test_file = "test_e2e_bench_quick.py"

    def __init__(self) -> None:
        self.wanted = False  # set by tests/conftest.py when the bench test is selected
        self.proc: subprocess.Popen | None = None

    @property
    def out(self) -> Path:
        from tests.conftest import TEST_STATE  # imported late: conftest imports this module

        return TEST_STATE / "bench-quick"

    def start(self, url: str) -> subprocess.Popen:
        """Start the run, or return the one already started."""
        from tests.conftest import EMBEDFLEET, MINILM, ROOT

        if self.proc is None:
            shutil.rmtree(self.out, ignore_errors=True)
            self.out.mkdir(parents=True)
            self.proc = subprocess.Popen(
                [EMBEDFLEET, "bench", "--quick", "--embedfleet-url", url,
                 "--embedfleet-model", MINILM, "--peers", ",".join(PEERS),
                 "--workloads", ",".join(WORKLOADS), "--out", str(self.out)],
                cwd=ROOT, text=True,
                env={**os.environ, "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1"},
                stdout=(self.out / "stdout.log").open("w"),
                stderr=(self.out / "stderr.log").open("w"))
        return self.proc

    def wait(self, timeout_s: float = 1800) -> int:
        """The run's exit code, once it ended (a run that outlives the timeout is stopped)."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return self.stop()

    def stop(self) -> int:
        """SIGINT first: the bench's `finally` stops its peers. `vllm serve` runs in a session of
        its own, so a SIGKILLed bench would leave it holding its port for the next session."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def log_tail(self) -> str:
        return "\n".join((self.out / name).read_text()[-3000:]
                         for name in ("stdout.log", "stderr.log") if (self.out / name).exists())


BACKGROUND_BENCH = BackgroundBench()
