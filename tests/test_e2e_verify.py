"""`embedfleet verify` against the session cluster, run the way users run it (`python -m`).

MiniLM must agree with transformers on the same weights (min cosine >= 0.999), a golden file it
saved must pass, a damaged one must fail with the golden row saying FAIL, and the tiny causal
Qwen3 (prefix caching on) must give the same vector on a cache hit as cold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from embedfleet.cluster.verify.command import BATCH, CACHE, CORPUS, GOLDEN, REFERENCE, load_golden, save_golden
from embedfleet.deployments.common.fingerprint import model_digest
from tests.conftest import MINILM, ROOT, TINY_QWEN3

pytestmark = pytest.mark.cluster


def verify_cli(url: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "embedfleet.cluster.verify.command", "--url", url, *args],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)


def report_of(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout)


def checks_of(report: dict, model: str) -> dict[str, dict]:
    entry = next(m for m in report["models"] if m["model"] == model)
    return {c["name"]: c for c in entry["checks"]}


def table_row(stdout: str, check: str) -> str:
    return next(line for line in stdout.splitlines() if line.strip("│┃ ").startswith(check))


@pytest.fixture(scope="module")
def minilm_run(cluster, tmp_path_factory) -> tuple[dict, Path]:
    """One verify of MiniLM (JSON report) that also saves its vectors as a golden file."""
    golden = tmp_path_factory.mktemp("verify") / "minilm-golden.npz"
    proc = verify_cli(cluster, "--model", MINILM, "--json", "--save-golden", str(golden))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return report_of(proc), golden


def test_minilm_agrees_with_the_transformers_reference(minilm_run, minilm_path):
    report, _ = minilm_run
    checks = checks_of(report, MINILM)
    assert report["passed"] and [m["model"] for m in report["models"]] == [MINILM]
    ref = checks[REFERENCE]
    assert ref["status"] == "PASS" and ref["min"] >= 0.999, ref
    assert ref["n"] == len(CORPUS) and len(ref["per_text"]) == len(CORPUS)
    assert ref["note"].startswith("MEAN pooling (modules.json), L2-normalised")
    assert checks[BATCH]["status"] == "PASS" and checks[BATCH]["min"] >= 0.99999
    # bidirectional model: the cluster serves it without prefix caching, so nothing to compare
    assert checks[CACHE]["status"] == "SKIP" and "prefix caching off" in checks[CACHE]["note"]
    assert report["models"][0]["fingerprint"]["x-embedfleet-model-digest"] == \
        model_digest(minilm_path)


def test_saved_golden_passes(cluster, minilm_run):
    _, golden = minilm_run
    saved = load_golden(golden)[MINILM]
    assert saved.texts == list(CORPUS) and saved.vectors.shape == (len(CORPUS), 384)
    proc = verify_cli(cluster, "--model", MINILM, "--golden", str(golden))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = table_row(proc.stdout, GOLDEN)
    assert "PASS" in row and "fingerprint matches" in row
    assert f"{MINILM}: PASS" in proc.stdout


@pytest.mark.parametrize("damage", ["permuted", "noised"])
def test_wrong_golden_fails_and_the_table_names_the_check(cluster, minilm_run, tmp_path, damage):
    _, golden = minilm_run
    entries = load_golden(golden)
    vectors = entries[MINILM].vectors
    if damage == "permuted":
        entries[MINILM].vectors = np.roll(vectors, 1, axis=0)
    else:  # cosine ~0.93 per text: plausible-looking vectors that are not the model's
        noise = np.random.default_rng(0).normal(0, 0.02, vectors.shape).astype(np.float32)
        entries[MINILM].vectors = vectors + noise
    wrong = tmp_path / "wrong-golden.json"
    save_golden(wrong, entries, "tampered")
    proc = verify_cli(cluster, "--model", MINILM, "--golden", str(wrong))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in table_row(proc.stdout, GOLDEN)
    assert f"{len(CORPUS)} of {len(CORPUS)} text(s) below 0.999" in proc.stdout
    for check in (REFERENCE, BATCH):  # only the golden comparison is wrong
        assert "PASS" in table_row(proc.stdout, check)
    assert "golden FAIL, worst texts:" in proc.stdout and f"{MINILM}: FAIL" in proc.stdout


def test_tiny_qwen3_cache_hit_equals_cold_and_matches_reference(cluster, tiny_qwen3_dir):
    proc = verify_cli(cluster, "--model", TINY_QWEN3, "--model-path",
                      f"{TINY_QWEN3}={tiny_qwen3_dir}", "--json")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    checks = checks_of(report_of(proc), TINY_QWEN3)
    cache = checks[CACHE]
    assert cache["status"] == "PASS" and cache["min"] >= 0.99999, cache
    assert min(cache["cached_tokens"]) > 0 and min(cache["prompt_tokens"]) >= 300
    ref = checks[REFERENCE]
    assert ref["status"] == "PASS" and ref["min"] >= 0.999, ref
    assert ref["note"].startswith("LAST pooling (modules.json), L2-normalised")
    assert checks[BATCH]["status"] == "PASS"


def test_unknown_model_is_a_usage_error(cluster):
    proc = verify_cli(cluster, "--model", "no-such-model")
    assert proc.returncode == 2 and "not served" in proc.stderr
