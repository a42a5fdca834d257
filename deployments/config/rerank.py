"""A reranker's config: its role, its ``hf_overrides`` (checked against the one table,
``engine/rerank_models.py``) and its canary triple.

Kept apart from the schema (``config/schema.py``) because only rerank models read it: the
replica's rerank path (``replica/rerank_path.py``) and its canary (``replica/canary.py``).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine.rerank_models import OverrideRefused, family_for, resolve_overrides

logger = logging.getLogger("embedfleet.config")

ModelTask = Literal["embed", "rerank"]


class RerankTriple(BaseModel):
    """A (query, relevant, irrelevant) triple the model must order: relevant above."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    query: str = Field(min_length=1, max_length=2000)
    relevant: str = Field(min_length=1, max_length=2000)
    irrelevant: str = Field(min_length=1, max_length=2000)


class RerankConfig(BaseModel):
    """What a ``task: rerank`` model scores pairs with, beyond its family's template."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    instruction: str | None = Field(
        default=None, max_length=2000, description="The instruction a templated reranker "
        "(Qwen3-Reranker) puts before every query; None = the family's own. Shared by every "
        "pair, so it is the prefix the cache and prefix-affinity routing share.")
    canary: RerankTriple | None = Field(
        default=None, description="A triple this model must order (relevant above irrelevant) "
        "before its replica serves; a failure marks the replica down. None = the shipped "
        "triple, which needs trained weights: set it for a model whose ordering of the shipped "
        "triple is not meaningful (random-weight test models).")


def check_rerank_fields(data: Any) -> Any:
    """A model's ``task``/``hf_overrides`` before validation: a known reranker family without its
    overrides gets them (an INFO line says so); wrong ones are refused with the fix."""
    if not isinstance(data, dict):
        return data
    src = data.get("source") or {}
    names = [str(data.get("name") or "")]
    if isinstance(src, dict):
        names += [str(v) for v in src.values() if v]
    fam = family_for(names)
    task = data.get("task", "embed")
    if fam is None:
        return data
    if task != "rerank":
        raise ValueError(f"model {data.get('name')!r} is a {fam.name} (by its name or source), "
                         "a reranker: set task: rerank")
    try:
        overrides, note = resolve_overrides(fam, data.get("hf_overrides"))
    except OverrideRefused as err:
        raise ValueError(f"model {data.get('name')!r}: {err}") from None
    if note:
        logger.info("model %r: %s", data.get("name"), note)
        data = {**data, "hf_overrides": overrides}
    return data
