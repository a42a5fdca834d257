"""Installed distributions for tests: real ``*.dist-info`` folders in a temporary site dir.

``importlib.metadata`` finds them on ``sys.path`` exactly as it finds pip-installed packages, so
code under test reads versions the way it does on a 910B node. Used with ``PYTHONPATH`` in a
subprocess, never by patching the code under test.
"""

from __future__ import annotations

from pathlib import Path


def install_dist(site: Path, name: str, version: str, *, package: str | None = None,
                 init: str = "") -> Path:
    """A dist-info for ``name==version`` (and optionally an importable ``package`` whose
    ``__init__.py`` holds ``init``) under ``site``; returns the dist-info folder."""
    site.mkdir(parents=True, exist_ok=True)
    dist = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (dist / "INSTALLER").write_text("test\n")
    (dist / "RECORD").write_text("")
    if package:
        (site / package).mkdir()
        (site / package / "__init__.py").write_text(init)
    return dist


# vllm_ascend/__init__.py of 0.23.0.post1 defines only register* functions: no __version__.
VLLM_ASCEND_INIT = '''"""Stand-in of vllm_ascend's top-level module: like the real one, no __version__."""


def register():
    return "vllm_ascend.platform.NPUPlatform"


def register_connector():
    pass
'''
