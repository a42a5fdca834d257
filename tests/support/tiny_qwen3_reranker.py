"""The tiny random-weight Qwen3 reranker of the tests (built by
``embedfleet.benchmarks.tiny_qwen3_reranker``, which the bench's rerank workload runs on too) and
transformers' reference computation of its scores.
"""

from __future__ import annotations

from pathlib import Path

from embedfleet.benchmarks.tiny_qwen3_reranker import DEFAULT_DIR, build_tiny_qwen3_reranker

__all__ = ["DEFAULT_DIR", "build_tiny_qwen3_reranker", "reference_scores"]


def reference_scores(folder: Path, token_ids: list[list[int]],
                     tokens: tuple[str, str] = ("no", "yes")) -> list[float]:
    """transformers' computation of the same model with the same override semantics: the causal
    LM's logits at the last token, softmax over (false, true) tokens, p(true)."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(folder)
    false_id, true_id = tok.convert_tokens_to_ids(list(tokens))
    model = Qwen3ForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in token_ids:
            logits = model(torch.tensor([ids])).logits[0, -1]
            pair = torch.stack([logits[false_id], logits[true_id]])
            out.append(float(torch.softmax(pair, dim=0)[1]))
    return out
