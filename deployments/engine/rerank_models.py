"""Which rerankers need what from vLLM: one table of families, their ``hf_overrides`` and score
templates, the way ``prefix_cache_policy`` is the one table for prefix-cache decisions.

Why a table: vLLM serves Qwen3-Reranker only through a non-obvious ``hf_overrides``. The
checkpoint is a causal LM (``Qwen3ForCausalLM``) whose "score" is p(yes) against p(no) at the
last token. ``architectures: [Qwen3ForSequenceClassification]`` turns it into a classifier;
``is_original_qwen3_reranker`` makes vLLM (``Qwen3ForSequenceClassificationConfig``) set the
``from_2_way_softmax`` method, which builds the score row as ``lm_head[yes] - lm_head[no]``
(``classifier_from_token`` names the two tokens, false first), so sigmoid(score) is the softmax's
p(yes). Without the overrides the model is served as an embedder; with a wrong architecture
(vllm-ascend 0.23's tutorial names ``Qwen3VLForSequenceClassification``) or swapped tokens it
gives plausible-looking, meaningless scores. The model was also trained on one prompt shape
(its model card's), so a family carries its template: the shared instruction prefix first, which
is also what prefix caching and prefix-affinity routing share between a request's pairs.

Pure: no vLLM import, no I/O. ``family_for`` matches a model by the names it is known by (path or
hub id) and, where the folder is at hand, by its ``config.json`` architecture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

QWEN3_RERANKER_OVERRIDES: dict[str, Any] = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}

_QWEN3_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
    "<|im_start|>user\n")
_QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@dataclass(frozen=True)
class ScoreTemplate:
    """How one (query, document) pair becomes the one text the model scores."""

    query: str
    """Format of the pair's first part: ``{instruction}`` and ``{query}``."""
    document: str
    """Format of its second part: ``{document}``."""
    default_instruction: str = ""

    def render(self, query: str, document: str, instruction: str | None = None) -> str:
        head = self.query.format(instruction=instruction or self.default_instruction,
                                 query=query)
        return head + self.document.format(document=document)


@dataclass(frozen=True)
class RerankFamily:
    name: str
    match_names: tuple[str, ...]
    """Lower-case substrings of a model's path or hub id that name the family."""
    match_architectures: tuple[str, ...]
    """``config.json`` architectures of the family's checkpoints (with a local folder)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    template: ScoreTemplate | None = None
    """None: the tokenizer's own pair encoding (a cross-encoder's ``[CLS] q [SEP] d [SEP]``)."""


FAMILIES: tuple[RerankFamily, ...] = (
    RerankFamily(
        name="Qwen3-Reranker",
        match_names=("qwen3-reranker", "qwen3_reranker"),
        match_architectures=(),  # a Qwen3ForCausalLM folder may be an embedder: named only
        overrides=QWEN3_RERANKER_OVERRIDES,
        template=ScoreTemplate(
            query=_QWEN3_PREFIX + "<Instruct>: {instruction}\n<Query>: {query}\n",
            document="<Document>: {document}" + _QWEN3_SUFFIX,
            default_instruction="Given a web search query, retrieve relevant passages that "
                                "answer the query")),
)


def family_for(names: list[str], architectures: list[str] | None = None) -> RerankFamily | None:
    """The family a model belongs to, from its path/hub id (and its folder's architectures)."""
    lowered = [n.lower() for n in names if n]
    for fam in FAMILIES:
        if any(m in n for m in fam.match_names for n in lowered):
            return fam
        if architectures and set(architectures) & set(fam.match_architectures):
            return fam
    return None


class OverrideRefused(ValueError):
    """A reranker's ``hf_overrides`` that would serve meaningless scores; says the fix."""


def resolve_overrides(fam: RerankFamily | None, given: dict[str, Any] | None
                      ) -> tuple[dict[str, Any] | None, str | None]:
    """(the overrides the engine gets, an INFO line when they were filled in).

    None given: the family's, said in the line. Given: every key the family needs must be there
    with the family's value, else ``OverrideRefused`` naming the right value and the whole fix;
    keys the family does not set are the operator's."""
    if fam is None or not fam.overrides:
        return given, None
    if given is None:
        return dict(fam.overrides), (f"{fam.name}: hf_overrides set to {fam.overrides} (vLLM "
                                     "serves this checkpoint as a reranker only with them)")
    wrong = {k: v for k, v in fam.overrides.items() if given.get(k) != v}
    if wrong:
        parts = "; ".join(f"{k} is {given.get(k, '<missing>')!r}, must be {v!r}"
                          for k, v in wrong.items())
        raise OverrideRefused(f"{fam.name} needs hf_overrides {fam.overrides}: {parts}. Fix: "
                              f"hf_overrides: {fam.overrides} (or leave hf_overrides out and "
                              "it is set for you)")
    return dict(given), None
