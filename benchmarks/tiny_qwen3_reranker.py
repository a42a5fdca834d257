"""A tiny random-weight Qwen3-Reranker-shaped checkpoint, built on demand (no download).

Qwen3-Reranker is a ``Qwen3ForCausalLM`` checkpoint whose score is p("yes") against p("no") at the
last token; vLLM serves it as a classifier only through the hf_overrides of the reranker table
(``engine/rerank_models.py``). This folder is the tiny Qwen3 embedder's causal LM
(``benchmarks/tiny_qwen3.py``: same config, weights and MiniLM tokenizer, whose vocabulary has
"yes" and "no"), without the sentence-transformers pooling files, in a folder whose name says
``qwen3-reranker`` as the real checkpoints' names do. Reused while its files are unchanged.

Here, not under tests/, because both the tests and `embedfleet bench`'s rerank workload
(``benchmarks/rerank_bench.py``) run on it, and the benchmarks never import the tests.
"""

from __future__ import annotations

import json
from pathlib import Path

from .tiny_qwen3 import TOKENIZER_FILES, build_in_place, build_tiny_qwen3

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / ".cache" / "models" / "tiny-qwen3-reranker"
COPIED = ("config.json", "generation_config.json", "model.safetensors", *TOKENIZER_FILES)


def _contents(src: Path) -> dict[str, bytes]:
    """The folder's files. The borrowed MiniLM (BERT) tokenizer would also return
    ``token_type_ids``, which Qwen3's tokenizer never does: vLLM's server passes them on to the
    engine, where ``Qwen3ForCausalLM.forward`` refuses them and the engine core dies. Declaring
    Qwen3's input names keeps the stand-in's tokenizer to what the real one returns."""
    out = {n: (src / n).read_bytes() for n in COPIED if (src / n).exists()}
    tok_cfg = json.loads(out["tokenizer_config.json"])
    tok_cfg["model_input_names"] = ["input_ids", "attention_mask"]
    out["tokenizer_config.json"] = (json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n").encode()
    return out


def build_tiny_qwen3_reranker(dest: Path = DEFAULT_DIR) -> Path:
    src = build_tiny_qwen3(ROOT / ".cache" / "models" / "tiny-qwen3")
    files = _contents(src)

    def built(folder: Path) -> bool:
        return folder.is_dir() and all((folder / n).exists() and (folder / n).read_bytes() == data
                                       for n, data in files.items())

    def write(tmp: Path) -> None:
        for n, data in files.items():
            (tmp / n).write_bytes(data)
    return build_in_place(dest, built, write)


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


# Candidates for the random-weight model's canary triple: its ordering of the shipped triple means
# nothing (random weights), so the triple is the best and the worst of these as transformers
# scores them, the way the e2e tests fix theirs.
CANARY_QUERY = "What is the capital of China?"
CANARY_DOCS = ("The capital of China is Beijing.", "Gravity is a force between two masses.",
               "Beijing has been the capital for centuries.", "Bananas are yellow.")


def reference_triple(folder: Path, template, query: str = CANARY_QUERY,
                     docs: tuple[str, ...] = CANARY_DOCS) -> tuple[list[float], dict[str, str]]:
    """transformers' reference scores of (query, each doc) rendered with the family's
    ``template``, and the (query, relevant, irrelevant) triple they fix: the best and the worst."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = [list(x) for x in tok([template.render(query, d) for d in docs])["input_ids"]]
    scores = reference_scores(folder, ids)
    best = max(range(len(docs)), key=lambda i: scores[i])
    worst = min(range(len(docs)), key=lambda i: scores[i])
    return scores, {"query": query, "relevant": docs[best], "irrelevant": docs[worst]}


def canary_triple(folder: Path, template) -> dict[str, str]:
    """The canary triple this checkpoint orders (``reference_triple`` of the candidates)."""
    return reference_triple(folder, template)[1]
