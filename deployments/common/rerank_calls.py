"""The rerank call across the router -> replica boundary, and its result.

Beside ``common/contracts.py``'s embed call, with the same shape of reasons: frozen dataclasses
with slots, pickled by Ray for every call. ``inputs`` lets the Router's remote caller
(``ingress/remote.py``) size a rerank call, and the prefix-affinity router key it, as they do an
embed call.
"""

from __future__ import annotations

from dataclasses import dataclass

from .contracts import Fingerprint, Lane


@dataclass(frozen=True, slots=True)
class RerankCall:
    """Score each document against the query: one engine sequence per pair."""

    query: str
    documents: list[str]
    request_id: str
    model: str
    truncate: bool = False  # a pair past the model's context: cut the document, else 400
    raw_scores: bool = False  # the classifier's logits, not its activation (sigmoid)
    lane: Lane = "interactive"

    @property
    def inputs(self) -> list[str]:
        return [self.query, *self.documents]

    # Prefix affinity (ingress/affinity.py) keys a call by these and its first input: a
    # reranker's instruction is the model's own, so its calls are keyed by their query, which
    # every pair of the call starts with after the instruction.
    @property
    def prompt_name(self) -> None:
        return None

    @property
    def task(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class RerankResult:
    scores: list[float]  # in document order
    prompt_tokens: int
    cached_tokens: int
    replica_id: str
    fingerprint: Fingerprint
