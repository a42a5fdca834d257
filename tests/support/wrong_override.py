"""FAULT INJECTOR for tests only: a reranker engine started with a wrong ``hf_overrides``.

The config refuses a Qwen3-Reranker's wrong overrides (engine/rerank_models.py), so a test that
needs a wrongly served reranker goes past it the way an unknown family would: the replica's
engine factory (Serve args ``engine_factory``) swaps the yes/no classifier tokens, and vLLM then
serves 1 - p(yes): plausible-looking, meaningless scores that the ordering canary must catch.
"""

from __future__ import annotations

from typing import Any

from embedfleet.deployments.engine.vllm_engine import VllmEmbeddingEngine

SWAPPED_TOKENS = ["yes", "no"]


def swapped_tokens_engine(kwargs: dict[str, Any]) -> VllmEmbeddingEngine:
    overrides = {**(kwargs.get("hf_overrides") or {}), "classifier_from_token": SWAPPED_TOKENS}
    return VllmEmbeddingEngine({**kwargs, "hf_overrides": overrides})


FACTORY = "tests.support.wrong_override:swapped_tokens_engine"
