"""A tiny random-weight Qwen3-Reranker-shaped checkpoint, built at test time (no download).

Qwen3-Reranker is a ``Qwen3ForCausalLM`` checkpoint whose score is p("yes") against p("no") at the
last token; vLLM serves it as a classifier only through the hf_overrides of the reranker table
(``engine/rerank_models.py``). This folder is the tiny Qwen3 embedder's causal LM
(``benchmarks/tiny_qwen3.py``: same config, weights and MiniLM tokenizer, whose vocabulary has
"yes" and "no"), without the sentence-transformers pooling files, in a folder whose name says
``qwen3-reranker`` as the real checkpoints' names do. Reused while its files are unchanged.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from embedfleet.benchmarks.tiny_qwen3 import TOKENIZER_FILES, build_tiny_qwen3

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = ROOT / ".cache" / "models" / "tiny-qwen3-reranker"
COPIED = ("config.json", "generation_config.json", "model.safetensors", *TOKENIZER_FILES)


def build_tiny_qwen3_reranker(dest: Path = DEFAULT_DIR) -> Path:
    src = build_tiny_qwen3(ROOT / ".cache" / "models" / "tiny-qwen3")
    dest = Path(dest)
    names = [n for n in COPIED if (src / n).exists()]
    if dest.is_dir() and all((dest / n).exists() and (dest / n).read_bytes() == (src / n).read_bytes()
                             for n in names):
        return dest
    tmp = dest.with_name(f".{dest.name}.building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for n in names:
        shutil.copyfile(src / n, tmp / n)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


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
