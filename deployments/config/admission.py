"""A model's ``admission`` and ``limits`` sections: the per-card admission budget in front of the
engine, and the bounds on one request's work. Kept apart from the rest of the schema
(``config/schema.py``) as the sections the replica's request path and the ingress's size checks
read.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)  # as every section of the config


class AdmissionConfig(_Strict):
    """Per-card admission budget in front of the engine (the governor lowers it under pressure).

    vLLM's scheduler limits are fixed at engine start, so the brake is here: sequences and tokens
    in flight per replica. ``None`` ceilings = the engine's ``max_num_seqs`` and
    ``max_num_batched_tokens``."""

    max_sequences: PositiveInt | None = None
    max_tokens: PositiveInt | None = None
    queue_timeout_s: PositiveFloat = Field(
        default=30, description="How long a call may wait for budget before it gets 429.")
    max_waiting: PositiveInt = Field(default=1024, description="Calls queued per replica.")
    large_call_tokens: PositiveInt | None = Field(
        default=None, description="An interactive call with more tokens than this (chunks "
        "included) goes to the engine in runs, each admitted on its own in the interactive "
        "lane behind the queries that came meanwhile and sent at bulk's vLLM priority, so one "
        "large request is one slow client and never a stalled card. None = an "
        "eighth of an engine step (engine.max_num_batched_tokens): a run that size is a short "
        "wait for a query on any card; for a reranker (task: rerank), whose every call is a "
        "query with its documents, a whole engine step.")
    bulk_max_waiting: PositiveInt | None = Field(
        default=None, description="Of max_waiting, the most bulk-lane calls that may queue (None "
        "= half); the rest is kept for interactive calls. Past it, bulk gets 429.")
    bulk_max_inflight_share: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.75, description="Share of the budget (sequences and tokens) bulk may hold in "
        "flight, so an interactive call arriving during a bulk flood starts at once.")
    bulk_min_share: Annotated[float, Field(ge=0, lt=1)] = Field(
        default=0.25, description="While both lanes wait, the least share of admitted tokens "
        "bulk gets: a steady interactive stream never starves it.")
    bulk_max_drain_s: PositiveFloat | None = Field(
        default=0.05, description="Bulk may also hold only the tokens the card drains in this "
        "long (its measured rate), and a bulk call goes to the engine in runs of that size, so "
        "an interactive call arriving during a bulk flood waits for at most about this much "
        "bulk work in the engine; null = the share alone.")

    @model_validator(mode="after")
    def _bulk_within_queue(self) -> "AdmissionConfig":
        if self.bulk_max_waiting is not None and self.bulk_max_waiting >= self.max_waiting:
            raise ValueError(f"admission.bulk_max_waiting ({self.bulk_max_waiting}) must be "
                             f"below admission.max_waiting ({self.max_waiting}), so interactive "
                             "calls always have room to queue")
        return self


# Characters a token may take, for the character bound derived from the token bound: English
# text runs about 4-5 characters a token in the BERT and Qwen tokenizers, so text at the token
# bound is well inside the characters bound, and a body far past it is refused before it is
# tokenised at all.
CHARS_PER_TOKEN_BOUND = 8
# A request's default token bound, in engine steps of ``max_num_batched_tokens``: a few full steps
# of the card, so one request's work is seconds on a card, never minutes.
REQUEST_STEPS_BOUND = 4


class RequestLimits(_Strict):
    """Bounds on one request's work, checked before the expensive part on every route.

    Characters are checked at the ingress, from the parsed body, before anything is tokenised;
    tokens after tokenising, before anything reaches the engine (chunks and their overlap
    counted: that is the engine's work). Past either, 413 with the limit and the value."""

    max_tokens: PositiveInt | None = Field(
        default=None, description="Tokens one engine call may make, chunk windows and their "
        "overlap included, checked at the replica once tokenised and before anything is "
        "admitted. The ingress has no tokenizer, and it splits a request of more than 128 "
        "inputs into slices of 128, each an engine call of its own: for text the bound is per "
        "slice, so a request of n slices may make up to n times it (max_chars bounds it as a "
        "whole before tokenising), and the first slice past it fails the request and "
        "cancels the others. Token-id inputs are also checked as a whole request at the "
        "ingress. Also the most tokens /tokenize returns. None = REQUEST_STEPS_BOUND engine "
        "steps (engine.max_num_batched_tokens each).")
    max_chars: PositiveInt | None = Field(
        default=None, description="Characters of one request's texts, all inputs together, "
        "checked before tokenising. None = CHARS_PER_TOKEN_BOUND x the token bound, so text "
        "that fits the token bound is never refused by it.")
