"""The vLLM-Ascend release embedfleet's ``ascend`` extra is pinned to, in one place.

Everything here was read from the release itself, not chosen: the plugin's sdist
(``vllm_ascend-0.23.0.post1.tar.gz`` on PyPI — there is no wheel of this version) declares its
requirements in ``PKG-INFO`` (``Requires-Dist``) and ``requirements.txt``, and its install guide
(``docs/source/installation.md``) and ``Dockerfile`` name the CANN, SoC and vLLM it is built with.
``pyproject.toml``'s ``ascend`` extra, ``cluster/install_ascend.sh`` and
``tests/test_ascend_install.py`` read or check these values; the test fails when the extra drifts
from what the sdist declares.

Plain constants only (no imports beyond the standard library), so the install script can read
this file before anything is installed.
"""

from __future__ import annotations

# -- the two packages built from source -------------------------------------------------------

# PKG-INFO "Version:" of the sdist; PyPI has wheels only for 0.23.0 and earlier, not for .post1.
VLLM_ASCEND_VERSION = "0.23.0.post1"
# installation.md builds vLLM "at the matching tag" (git clone --branch |vllm_version|), and the
# sdist's Dockerfile has ARG VLLM_TAG=v0.23.0; installed with VLLM_TARGET_DEVICE=empty, which
# makes vLLM's setup.py install requirements/common.txt only (no torch, no kernels).
VLLM_VERSION = "0.23.0"
VLLM_TARGET_DEVICE = "empty"

# -- what vllm-ascend 0.23.0.post1 declares (PKG-INFO Requires-Dist == requirements.txt) ------

TORCH = "2.10.0"  # Requires-Dist: torch==2.10.0
TORCH_NPU = "2.10.0.post4"  # Requires-Dist: torch-npu==2.10.0.post4
TORCHVISION = "0.25.0"  # Requires-Dist: torchvision==0.25.0 (so never uninstalled on Ascend)
TORCHAUDIO = "2.10.0"  # Requires-Dist: torchaudio==2.10.0 (idem)
TRITON_ASCEND = "3.2.2"  # Requires-Dist: triton-ascend==3.2.2 (on Huawei's index, not PyPI)
TRANSFORMERS = "5.5.4"  # Requires-Dist: transformers==5.5.4
FASTAPI_SPEC = "<0.124.0"  # Requires-Dist: fastapi<0.124.0 (an upper bound, not a pin)

# -- platform facts from docs/source/installation.md and the Dockerfile ---------------------------

# Requirements table: "CANN == 9.1.0" and "NNAL == 9.1.0" (NNAL provides libatb.so); the
# Dockerfile builds FROM quay.io/ascend/cann:9.1.0-910b-ubuntu22.04-py3.12. The seed's runtime
# minimum (deployments/engine/ascend_checks.py MIN_CANN) was 8.1.RC1.
CANN_VERSION = "9.1.0"
NNAL_VERSION = "9.1.0"
# "Atlas A2: export SOC_VERSION=ascend910b1" (needed when building where npu-smi is absent);
# also the Dockerfile's ARG SOC_VERSION="ascend910b1". The 910B is an Atlas A2 part.
SOC_VERSION = "ascend910b1"
# "Python: >= 3.10, < 3.13" (PKG-INFO itself only says Requires-Python: >=3.10).
PYTHON_SPEC = ">=3.10,<3.13"
# The base image's OS: Ubuntu 22.04, glibc 2.35 — the newest manylinux tag a target accepts.
TARGET_GLIBC = (2, 35)

# -- where the pieces come from ---------------------------------------------------------------

# installation.md: "pip install triton-ascend==3.2.2 --extra-index-url <this>"; the Dockerfile
# also sets PIP_EXTRA_INDEX_URL to it while building the plugin.
HUAWEI_PYPI_INDEX = "https://mirrors.huaweicloud.com/ascend/repos/pypi"
# The Dockerfile installs vLLM and the plugin with --extra-index <this> (torch 2.10.0+cpu: no
# CUDA libraries, no `triton`, which clashes with triton-ascend). torch-npu 2.10.0.post4's x86_64
# wheel requires torch==2.10.0+cpu, which only this index publishes (its aarch64 wheel asks for
# plain torch==2.10.0).
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu/"

# The sdists on PyPI (filename, URL, sha256 as PyPI's simple API lists them). The test checks
# the hashes against PyPI again; the install script checks every download against them.
SDISTS = {
    "vllm": (
        "vllm-0.23.0.tar.gz",
        ("https://files.pythonhosted.org/packages/68/c6/"
         "c4dc766b09e93de278693502612de0beba822983d4f609830406ead65cc9/vllm-0.23.0.tar.gz"),
        "760269db3d9611e12e524681df1bca0977d5d2f5fcb4481cc34d33efc4ae7ff5",
    ),
    "vllm-ascend": (
        "vllm_ascend-0.23.0.post1.tar.gz",
        ("https://files.pythonhosted.org/packages/ab/7a/32a1b1f13467fb7372588206fa1ffb735f28dcd85"
         "04d562f5c7ccdbd90d0/vllm_ascend-0.23.0.post1.tar.gz"),
        "a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1",
    ),
}

# Ray for the Ascend stack: every Ray from 2.56.0 on requires fastapi>=0.133.0 (its serve extra),
# and the plugin declares fastapi<0.124.0, so 2.55.1 is the newest that resolves with it.
# tests/test_ray_api.py checks embedfleet's Ray touch points against 2.55.1's sources too.
RAY = "2.55.1"

# The distributions the ``ascend`` extra must pin (and pin exactly as the plugin declares).
REQUIRED_IN_EXTRA = ("torch", "torch-npu", "triton-ascend", "transformers")
