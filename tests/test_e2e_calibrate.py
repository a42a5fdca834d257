"""`embedfleet calibrate` against the session cluster's config, then a governor started after it.

Calibrate runs the real command on tiny-qwen3 (its own engine beside the cluster's, on the CPU
card stand-in of 512 MiB): the worst step the config allows is 4 x 4,096 tokens. It writes the
profile where the governor looks (<state dir>/profiles/embedfleet--tiny-qwen3.json; the test
session's EMBEDFLEET_STATE_DIR is the cluster's too). The governor reads profiles when it starts,
so the test then SIGKILLs the governor replica; the one Serve starts in its place must give
tiny-qwen3's card the profile's band (``governor_law.params_for_profile``) and name the file. The
profile is removed and the governor restarted again at the end, so later tests see the
configured band.
"""

from __future__ import annotations

import json

import pytest

from embedfleet.deployments.config.schema import load_config
from embedfleet.deployments.fleet.governor_law import params_for_profile
from embedfleet.deployments.engine.card_profile import default_profile_path, load_profile
from tests.conftest import E2E_CONFIG, TINY_QWEN3, run_cli
from tests.test_e2e_governor import cards, restart_governor_and_read

pytestmark = pytest.mark.cluster


def test_a_governor_started_after_calibrate_uses_the_profile(cluster):
    cfg = load_config(E2E_CONFIG)
    path = default_profile_path(cfg.app_name, TINY_QWEN3)
    path.unlink(missing_ok=True)
    ((card, _),) = cards(cluster, TINY_QWEN3).items()
    try:
        # A 64 MiB margin: the band's top (where only the margin is left) is then 320/384 of
        # what the KV pool leaves, visibly not the configured 0.9.
        proc = run_cli("calibrate", "--config", str(E2E_CONFIG), "--model", TINY_QWEN3,
                       "--margin-bytes", str(64 << 20), "--json", timeout=1200)
        last = json.loads(proc.stdout.strip().splitlines()[-1])
        assert list(last)[-5:] == ["card_total_bytes", "kv_pool_bytes", "worst_step_peak_bytes",
                                   "headroom_bytes", "verdict"], last
        assert last["verdict"] == "fits" and last["profile"] == str(path), last
        assert last["worst_step"] == {"sequences": 4, "tokens": 16384,
                                      "tokens_per_sequence": 4096}
        assert last["card_total_bytes"] == cfg.platform.cpu_card_memory_bytes
        profile = load_profile(path)
        assert profile.source == "measured" and profile.fits
        want = params_for_profile(cfg.governor.params, profile)
        assert want.high != cfg.governor.params.high and want.low != cfg.governor.params.low

        seen = restart_governor_and_read(card)
        assert seen["model"] == TINY_QWEN3 and seen["profile"] == str(path), seen
        assert seen["high"] == pytest.approx(want.high) and seen["low"] == pytest.approx(
            want.low), (seen, want)
    finally:
        path.unlink(missing_ok=True)
        restored = restart_governor_and_read(card)
        assert restored["profile"] is None, restored
        assert (restored["high"], restored["low"]) == (cfg.governor.params.high,
                                                       cfg.governor.params.low)
