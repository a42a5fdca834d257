"""Cluster shape: one replica per card, extra replicas pending and reported, health and models."""

from __future__ import annotations

import time

import pytest
import requests

from tests.conftest import FAULTY_QWEN3, MINILM, TINY_QWEN3, run_cli, write_serve_config

pytestmark = pytest.mark.cluster


def models(cluster) -> dict[str, dict]:
    body = requests.get(f"{cluster}/v1/models", timeout=10).json()
    assert body["object"] == "list"
    return {m["id"]: m for m in body["data"]}


def test_health_and_ready(cluster):
    assert requests.get(f"{cluster}/health", timeout=10).json() == {"status": "ok"}
    ready = requests.get(f"{cluster}/ready", timeout=10)
    assert ready.status_code == 200
    assert all(n >= 1 for n in ready.json()["models"].values())
    assert set(ready.json()["models"]) == {MINILM, TINY_QWEN3, FAULTY_QWEN3}


def test_models_lists_served_models_with_facts(cluster):
    by_id = models(cluster)
    m = by_id[MINILM]
    assert m["object"] == "model" and m["owned_by"] == "embedfleet"
    assert m["max_input_tokens"] == 256 and m["dimensions"] == 384
    assert m["replicas"]["ready"] == 2
    assert m["prefix_cache"]["enabled"] is False
    assert "bidirectional" in m["prefix_cache"]["reason"]
    q = by_id[TINY_QWEN3]
    assert q["dimensions"] == 128 and q["max_input_tokens"] == 4096


def test_replicas_hold_different_cards(cluster):
    by_id = models(cluster)
    cards = [(c["node"], c["device"]) for m in by_id.values() for c in m["replicas"]["cards"]]
    # Four logical cards, four replicas: Ray set a different ASCEND_RT_VISIBLE_DEVICES for each.
    assert len(cards) == 4 and len(set(cards)) == 4, cards
    assert sorted(d for _, d in cards) == ["0", "1", "2", "3"]
    minilm = by_id[MINILM]["replicas"]["cards"]
    assert len({c["device"] for c in minilm}) == 2


def test_more_replicas_than_cards_stay_pending_and_status_says_so(cluster, cluster_status):
    # Ask for a third MiniLM replica while all 4 cards are taken (a replica-count change only,
    # so Serve keeps the running replicas).
    run_cli("deploy", "--address", "http://127.0.0.1:8265", "--serve-config",
            str(write_serve_config(extra_minilm_replicas=1)), timeout=600)
    try:
        deadline = time.monotonic() + 90
        while True:
            st = {m["model"]: m for m in cluster_status()["models"]}
            m = st[MINILM]
            if (m["pending"] and m["replica_states"].get("RUNNING") == 2) or \
                    time.monotonic() > deadline:
                break
            time.sleep(3)
        assert m["replica_states"].get("RUNNING") == 2, m
        assert "1 replica(s) waiting for a card" in m["pending"], m
        assert '"NPU": 1' in m["pending"] and "0 of the cluster's 4 cards are free" in m["pending"]
        assert m["ready"] == 2
        # nothing crashed: every model still serves
        assert requests.get(f"{cluster}/ready", timeout=10).status_code == 200
        out = run_cli("status", "--config", str(__import__("tests.conftest").conftest.E2E_CONFIG))
        assert "waiting for a card" in out.stdout
        resp = requests.post(f"{cluster}/v1/embeddings", json={"model": MINILM, "input": "still up"},
                             timeout=60)
        assert resp.status_code == 200
    finally:
        # Give the card request back: a replica left pending would take the next card any
        # other test frees (a killed replica's), and starve that model's replacement.
        run_cli("deploy", "--address", "http://127.0.0.1:8265", "--serve-config",
                str(write_serve_config()), timeout=900)
