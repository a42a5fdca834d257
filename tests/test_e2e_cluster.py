"""Cluster shape: one replica per card, extra replicas pending and reported, health and models."""

from __future__ import annotations

import requests

from tests.conftest import MINILM

import pytest

pytestmark = pytest.mark.cluster


def test_health_and_ready(cluster):
    assert requests.get(f"{cluster}/health", timeout=10).json() == {"status": "ok"}
    ready = requests.get(f"{cluster}/ready", timeout=10)
    assert ready.status_code == 200
    assert ready.json()["models"][MINILM] >= 1


def test_models_lists_served_model_with_facts(cluster):
    body = requests.get(f"{cluster}/v1/models", timeout=10).json()
    assert body["object"] == "list"
    (m,) = body["data"]
    assert m["id"] == MINILM and m["object"] == "model"
    assert m["max_input_tokens"] == 256
    assert m["dimensions"] == 384
    assert m["replicas"]["ready"] == 2
    assert m["prefix_cache"]["enabled"] is False and m["prefix_cache"]["reason"]


def test_replicas_hold_different_cards(cluster):
    cards = requests.get(f"{cluster}/v1/models", timeout=10).json()["data"][0]["replicas"]["cards"]
    devices = sorted(c["device"] for c in cards)
    # Two logical cards; Ray sets ASCEND_RT_VISIBLE_DEVICES per replica, one card each.
    assert devices == ["0", "1"], cards
    assert len({c["replica_id"] for c in cards}) == 2


def test_more_replicas_than_cards_stay_pending_and_status_says_so(cluster_status):
    st = cluster_status()
    (m,) = st["models"]
    assert m["ready"] == 2
    assert m["replica_states"].get("RUNNING") == 2
    pending = sum(v for k, v in m["replica_states"].items() if k != "RUNNING")
    assert pending == 1, m["replica_states"]
    assert '"NPU": 1' in m["message"] and "scheduled" in m["message"], m["message"]
    assert sorted(c["device"] for c in m["cards"]) == ["0", "1"]
