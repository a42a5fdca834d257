"""The tiny random-weight Qwen3 reranker of the tests (built by
``embedfleet.benchmarks.tiny_qwen3_reranker``, which the bench's rerank workload runs on too) and
transformers' reference computation of its scores.
"""

from __future__ import annotations

from embedfleet.benchmarks.tiny_qwen3_reranker import (DEFAULT_DIR, build_tiny_qwen3_reranker,
                                                       reference_scores)

__all__ = ["DEFAULT_DIR", "build_tiny_qwen3_reranker", "reference_scores"]
