"""The README's first screen, its size and links, and its examples: the examples run against the
live cluster. The links of the docs it points into are checked too (files and anchors), so a moved
or renamed section cannot leave a dead link behind."""

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


def test_readme_is_a_product_page_not_a_notebook():
    assert len(README.splitlines()) <= 250  # the rest lives in docs/ (issue 41)
    assert "benchmarks/results" not in README  # raw runs are not in git; baselines are


def _anchors(path) -> set[str]:
    """GitHub's heading anchors of a Markdown file, and its explicit <a id="...">."""
    text = path.read_text()
    found = set(re.findall(r'<a id="([^"]+)">', text))
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


MARKDOWN = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    text = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", path.read_text(), flags=re.S))
    dead = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            dead.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            dead.append(target)
    assert not dead, f"{path.relative_to(ROOT)}: dead links {dead}"
