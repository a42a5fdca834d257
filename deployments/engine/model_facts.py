"""What a local model folder is, as vLLM will run it: the ``ModelFacts`` the prefix-cache policy needs.

Facts come from the model's own files and from vLLM's model registry, never from the model's name,
and mirror the order in which vLLM resolves them (vLLM 0.32, ``vllm/config/model.py``):

* pooling type - ``ModelConfig.__post_init__``: an explicit override, else the sentence-transformers
  ``modules.json`` Pooling module (``transformers_utils.config.get_pooling_config``), else the
  architecture's ``default_seq_pooling_type`` declared on vLLM's model class;
* attention - ``ModelConfig.attn_type`` for pooling models: encoder-only (bidirectional) when the
  architecture's default pooling is CLS or the HF config says ``is_causal: false``, else the
  model class's ``attn_type`` (``decoder`` = causal);
* KV-cache dtype - the engine's ``kv_cache_dtype``, or int8 when the checkpoint is a ModelSlim one
  whose ``quant_model_description.json`` declares ``kv_cache_type: C8`` (vllm-ascend then quantises
  the KV cache whatever the engine flag says).

Nothing here loads weights. Reading the folder is plain JSON; the architecture defaults need vLLM's
registry (measured on the 2-core dev box: importing it ~9-10 s, once per process; a lookup < 1 ms
once vLLM's ``modelinfos`` cache under ``VLLM_CACHE_ROOT`` holds the class, ~12 s for a first-ever
lookup, which vLLM runs in a subprocess). Callers without vLLM pass ``arch_defaults`` themselves.
``tests/test_model_facts.py`` checks this mirror against vLLM's own ``ModelConfig``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .prefix_cache_policy import Attention, ModelFacts


class ModelFactsError(Exception):
    """The folder cannot be described: missing/invalid config, or an architecture vLLM lacks."""


@dataclass(frozen=True)
class ArchDefaults:
    """What vLLM's model class for an architecture declares (``_ModelInfo`` in vLLM's registry)."""

    vllm_class: str
    attn_type: str
    """``decoder``, ``encoder_only``, ``encoder_decoder``, ``hybrid`` or ``attention_free``."""
    seq_pooling: str
    tok_pooling: str


@dataclass(frozen=True)
class SentenceTransformersPooling:
    """The pooling a sentence-transformers folder declares, parsed the way vLLM parses it."""

    seq_pooling: str | None
    tok_pooling: str | None
    normalize: bool


# vLLM's pooling vocabulary (vllm/config/pooler.py) and the sentence-transformers module types it
# recognises (vllm/transformers_utils/config.py); copied so that reading a folder needs no vLLM.
SEQ_POOLING_TYPES = ("CLS", "LAST", "MEAN")
TOK_POOLING_TYPES = ("ALL", "STEP")
_ST_POOLING_MODULES = {
    "sentence_transformers.models.Pooling",
    "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
}
_ST_NORMALIZE_MODULES = {
    "sentence_transformers.models.Normalize",
    "sentence_transformers.base.modules.normalize.Normalize",
    "sentence_transformers.sentence_transformer.modules.normalize.Normalize",
}
# vllm-ascend's ModelSlim loader reads this file; kv_cache_type "C8" switches on the int8 KV path.
MODELSLIM_DESCRIPTION = "quant_model_description.json"

_ATTENTION_OF_ATTN_TYPE: dict[str, Attention] = {"decoder": "causal", "encoder_only": "bidirectional"}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ModelFactsError(f"{path}: unreadable JSON ({exc})") from exc


def parse_pooling_name(name: str) -> str:
    """``pooling_mode_mean_tokens`` -> ``MEAN``, ``pooling_mode_lasttoken`` -> ``LAST`` (as vLLM)."""
    name = name.removeprefix("pooling_mode_").split("_", 1)[0]
    return "LAST" if "lasttoken" in name else name.upper()


def read_sentence_transformers_pooling(model_dir: Path) -> SentenceTransformersPooling | None:
    """Pooling from ``modules.json``; None when the folder is not a sentence-transformers model."""
    modules = _read_json(model_dir / "modules.json")
    if not modules:
        return None
    types = {m.get("type") for m in modules}
    pooling = next((m for m in modules if m.get("type") in _ST_POOLING_MODULES), None)
    if pooling is None:
        return None
    settings = _read_json(model_dir / pooling.get("path", "") / "config.json") or {}
    seq = tok = None
    # vLLM walks every key and keeps the last recognised one; e.g. MAX or WEIGHTEDMEAN are not
    # vLLM pooling types and fall through to the architecture default.
    for key, value in settings.items():
        if key == "pooling_mode" and isinstance(value, str):
            kind = parse_pooling_name(value)
        elif value is True:
            kind = parse_pooling_name(key)
        else:
            continue
        if kind in SEQ_POOLING_TYPES:
            seq = kind
        elif kind in TOK_POOLING_TYPES:
            tok = kind
    return SentenceTransformersPooling(seq, tok, normalize=bool(types & _ST_NORMALIZE_MODULES))


@functools.cache
def vllm_arch_defaults(architecture: str) -> ArchDefaults | None:
    """Ask vLLM's model registry what its class for ``architecture`` declares; None if unknown.

    Uses the registry's per-architecture inspection (what ``ModelConfig`` itself calls, through
    ``embedfleet.deployments.engine.vllm_api``), which reads class attributes and never builds the model.
    """
    try:
        from .vllm_api import inspect_architecture

        info = inspect_architecture(architecture)
    except ImportError as exc:
        raise ModelFactsError(
            "vLLM is not importable here; pass arch_defaults= to read_model_facts"
        ) from exc
    if info is None:
        return None
    return ArchDefaults(vllm_class=info.vllm_class, attn_type=info.attn_type,
                        seq_pooling=info.seq_pooling, tok_pooling=info.tok_pooling)


def _resolve_architecture(
    architectures: list[str], lookup: Callable[[str], ArchDefaults | None]
) -> tuple[str, ArchDefaults]:
    # vLLM takes the first architecture its registry knows.
    for arch in architectures:
        defaults = lookup(arch)
        if defaults is not None:
            return arch, defaults
    raise ModelFactsError(
        f"none of the architectures {architectures} is in vLLM's model registry; "
        "embedfleet only serves models vLLM implements natively"
    )


def _attention(hf_config: dict[str, Any], defaults: ArchDefaults) -> Attention:
    # Mirrors ModelConfig.attn_type for pooling runners: CLS-default classes are BERT-style
    # encoders, and `is_causal: false` marks bidirectional conversions (LLM2Vec, gte-Qwen2...).
    if defaults.seq_pooling == "CLS" or not hf_config.get("is_causal", True):
        return "bidirectional"
    attention = _ATTENTION_OF_ATTN_TYPE.get(defaults.attn_type)
    if attention is None:
        raise ModelFactsError(
            f"{defaults.vllm_class} has attn_type={defaults.attn_type!r}; vLLM has no pooling "
            "models of that kind"
        )
    return attention


def declared_kv_cache_dtype(model_dir: Path) -> str | None:
    """The KV-cache dtype the checkpoint itself imposes, if any (ModelSlim C8 -> ``int8``)."""
    description = _read_json(model_dir / MODELSLIM_DESCRIPTION) or {}
    return "int8" if description.get("kv_cache_type") == "C8" else None


def read_model_facts(
    model_dir: str | Path,
    *,
    kv_cache_dtype: str = "auto",
    pooling_override: str | None = None,
    arch_defaults: Callable[[str], ArchDefaults | None] = vllm_arch_defaults,
) -> ModelFacts:
    """Facts for the model in ``model_dir`` served by vLLM with ``runner="pooling"``.

    ``kv_cache_dtype`` is the engine argument; ``pooling_override`` is a ``pooler_config``
    pooling type the deployment sets explicitly (it wins, as in vLLM).
    """
    model_dir = Path(model_dir)
    hf_config = _read_json(model_dir / "config.json")
    if not isinstance(hf_config, dict):
        raise ModelFactsError(f"{model_dir}: no config.json (a local Hugging Face model folder?)")
    architectures = hf_config.get("architectures") or []
    if not architectures:
        raise ModelFactsError(f"{model_dir}/config.json lists no architectures")
    arch, defaults = _resolve_architecture(architectures, arch_defaults)

    st = read_sentence_transformers_pooling(model_dir)
    pooling = (pooling_override or (st.seq_pooling if st else None) or defaults.seq_pooling)
    kv = kv_cache_dtype if kv_cache_dtype != "auto" else declared_kv_cache_dtype(model_dir) or "auto"
    return ModelFacts(
        architecture=arch,
        attention=_attention(hf_config, defaults),
        pooling=pooling.upper(),
        kv_cache_dtype=kv,
    )
