"""The README's first screen and its examples: the examples run against the live cluster."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def test_first_screen_names_the_two_commands():
    first_screen = "\n".join(README.splitlines()[:25])
    assert "make run" in first_screen and "make test" in first_screen


@pytest.mark.cluster
def test_curl_example_runs(cluster):
    (curl,) = [b for b in blocks("sh") if "curl" in b]
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", curl], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    n, dims, usage = out.stdout.split(" ", 2)
    assert (n, dims) == ("2", "384") and "prompt_tokens" in usage


@pytest.mark.cluster
def test_openai_example_runs(cluster):
    (example,) = blocks("python")
    out = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    dims, tokens, similarity = out.stdout.split()
    assert dims == "384" and int(tokens) > 10
    assert 0.3 < float(similarity) < 1.0  # related sentences, unit vectors


def test_makefile_targets_exist_and_ci_calls_make_test():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^run:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()
