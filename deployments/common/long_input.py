"""The long-input policy: what happens to an input longer than the model's context.

vLLM rejects such inputs (or, with its chunked processing, merges chunk vectors without
re-normalising); TEI silently truncates. embedfleet lets each model set a default and each request
choose, and reports what it did per input:

* ``reject``   - a 400 (``InputTooLong``) naming the input's length and the model's limit;
* ``truncate`` - keep the beginning (``right``: cut the right end, TEI's/HF's naming) or the end
  (``left``) so the input is exactly ``max_len`` tokens;
* ``chunk``    - overlapping windows, each embedded as its own sequence, merged by ``merge`` into a
  token-weighted mean, re-normalised when the model normalises. ``chunk_above`` says which inputs
  are split: ``max_model_len`` (those the model cannot take whole) or ``always`` (every input
  longer than one window: the seed's form for documents, 400-token windows with 50 of overlap,
  faster than one long sequence since attention grows with the square of the length).

Whatever the mode, an input longer than ``max_total_tokens`` is rejected: chunking turns one input
into many engine sequences, so an unbounded input would be an unbounded amount of work.

Inputs that fit the model are never altered unless the policy is ``chunk`` with ``chunk_above:
always`` (then an input longer than one window is split even if the model could take it whole);
an input no longer than one window is never altered, whatever the policy.

Special tokens. A tokenizer wraps the content in special tokens - BERT: ``[CLS] ... [SEP]``;
Qwen3-Embedding: ``... <|endoftext|>`` (its last-token pooling reads that EOS). A cut or a window
must not lose them, or every piece after the first would be pooled from a sequence the model never
saw in training (no CLS, no EOS). So ``plan`` strips the wrapper, cuts the *content*, and
re-wraps every piece with the same prefix and suffix. ``SpecialTokens`` is detected from the
tokenizer itself, never from the model's name. Token-id input that arrives without the wrapper
stays without it: the wrapper is re-added only to the ends where the original input carried it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator

from .errors import InputTooLong, InvalidParameterValue, UnsupportedParameter

LongInputMode = Literal["reject", "truncate", "chunk"]
TruncationDirection = Literal["right", "left"]
ChunkAbove = Literal["max_model_len", "always"]
_PROBE_TEXT = "embedfleet probe"


class LongInputPolicy(BaseModel):
    """Per model default (config) and per request override of the long-input handling."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: LongInputMode = Field(
        default="reject", description="What to do with an input longer than the model's maximum "
        "length: refuse it (400), cut it, or split it into windows and merge their vectors.")
    truncation_direction: TruncationDirection = Field(
        default="right", description="With truncate: right keeps the beginning (cuts the right "
        "end), left keeps the end.")
    chunk_tokens: PositiveInt | None = Field(
        default=None, description="Chunk window in tokens, special tokens included; null: the "
        "model's maximum length. A larger value is capped at it. The seed's windows for documents "
        "are 400 tokens.")
    chunk_overlap: NonNegativeInt = Field(
        default=50, description="Content tokens shared by consecutive windows, so no sentence is "
        "only ever seen cut.")
    chunk_above: ChunkAbove = Field(
        default="max_model_len", description="With chunk, which inputs are split: max_model_len "
        "chunks only inputs the model cannot take whole; always chunks every input longer than "
        "one window (the seed's form for documents: short windows are faster than one long "
        "sequence, and the index holds the windows' mean).")
    max_total_tokens: PositiveInt | None = Field(
        default=None, description="Bound on any one input in every mode (chunking included); "
        "null: no bound beyond the request's own limits.")

    @model_validator(mode="after")
    def _overlap_below_window(self) -> LongInputPolicy:
        if self.chunk_tokens is not None and self.chunk_overlap >= self.chunk_tokens:
            raise ValueError(f"chunk_overlap ({self.chunk_overlap}) must be smaller than "
                             f"chunk_tokens ({self.chunk_tokens})")
        return self

    def window(self, max_len: int) -> int:
        """Tokens per chunk for a model of ``max_len`` positions (special tokens included)."""
        return min(self.chunk_tokens or max_len, max_len)

    def check_model(self, max_len: int, special: SpecialTokens) -> None:
        """Raise ``ValueError`` if this policy cannot work for the model; call at start-up so a
        misconfiguration fails the deployment rather than the first long request."""
        room = self.window(max_len) - special.count
        if self.mode == "truncate" and max_len - special.count < 1:
            raise ValueError(f"max_len ({max_len}) leaves no room for content after "
                             f"{special.count} special tokens")
        if self.mode == "chunk" and room <= self.chunk_overlap:
            raise ValueError(
                f"chunk window of {self.window(max_len)} tokens minus {special.count} special "
                f"tokens leaves {room} content tokens, not more than chunk_overlap "
                f"({self.chunk_overlap})")


@dataclass(frozen=True)
class SpecialTokens:
    """The ids a tokenizer puts before and after the content of every input."""

    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Accept lists from callers and config; tuples keep the value hashable and comparable.
        object.__setattr__(self, "prefix", tuple(int(t) for t in self.prefix))
        object.__setattr__(self, "suffix", tuple(int(t) for t in self.suffix))

    @property
    def count(self) -> int:
        return len(self.prefix) + len(self.suffix)

    @classmethod
    def from_probe(cls, with_special: Sequence[int],
                   without_special: Sequence[int]) -> SpecialTokens:
        """Split the ids of one probe text tokenised with and without special tokens.

        Tokenising ``""`` alone cannot say which specials go first and which last (BERT's
        ``[CLS, SEP]`` vs a causal model's ``[BOS, EOS]`` look alike), so a non-empty probe is
        located inside the wrapped ids.
        """
        w, c = list(with_special), list(without_special)
        if not c:
            raise ValueError("the probe text tokenised to no content tokens")
        for start in range(len(w) - len(c) + 1):
            if w[start:start + len(c)] == c:
                return cls(tuple(w[:start]), tuple(w[start + len(c):]))
        raise ValueError(f"content ids {c} not found inside {w}: the tokenizer's special-token "
                         "template changes the content, cannot detect its prefix and suffix")

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, probe: str = _PROBE_TEXT) -> SpecialTokens:
        """Detect from a Hugging Face tokenizer (the same one the engine uses)."""
        return cls.from_probe(tokenizer(probe, add_special_tokens=True)["input_ids"],
                              tokenizer(probe, add_special_tokens=False)["input_ids"])

    def split(self, ids: Sequence[int]) -> tuple[tuple[int, ...], list[int], tuple[int, ...]]:
        """(prefix present, content, suffix present) of ``ids``."""
        ids = list(ids)
        n_pre = len(self.prefix) if tuple(ids[:len(self.prefix)]) == self.prefix else 0
        rest = ids[n_pre:]
        has_suffix = bool(self.suffix) and tuple(rest[-len(self.suffix):]) == self.suffix
        n_suf = len(self.suffix) if has_suffix else 0
        return self.prefix[:n_pre], rest[:len(rest) - n_suf], self.suffix[:n_suf]


@dataclass(frozen=True)
class InputPlan:
    """What to send to the engine for one input, and what to tell the client about it."""

    pieces: list[list[int]]
    """Token-id sequences to embed; one unless chunked."""
    weights: list[int]
    """Tokens per piece: the weights of ``merge``'s mean."""
    truncated: bool
    dropped_tokens: int
    """Content tokens that reach no piece (truncation); 0 when chunked or untouched."""
    chunks: int
    """Pieces the input became: 1 unless chunked."""
    input_tokens: int
    """The input's own length, before any cut."""

    @property
    def embedded_tokens(self) -> int:
        """Tokens the engine processes (overlap and re-added special tokens counted)."""
        return sum(self.weights)

    def report(self) -> dict[str, Any]:
        """The per-input note for responses, in an extension field OpenAI clients ignore."""
        return {"truncated": self.truncated, "dropped_tokens": self.dropped_tokens,
                "chunks": self.chunks, "input_tokens": self.input_tokens}


def _too_long(what: str, n: int, limit: int, limit_name: str, hint: str,
              param: str) -> InputTooLong:
    return InputTooLong(f"{what} has {n} tokens, more than {limit_name} of {limit} tokens{hint}",
                        param=param)


def plan(token_ids: Sequence[int], max_len: int, policy: LongInputPolicy,
         special: SpecialTokens, *, what: str = "input", param: str = "input") -> InputPlan:
    """Decide how one tokenised input (special tokens included) reaches the engine.

    ``what`` names the input in error messages (e.g. ``input[3]``), ``param`` the request field
    (``input`` on /v1/embeddings, ``inputs`` on /embed). Raises ``InputTooLong``.
    """
    ids = list(token_ids)
    n = len(ids)
    if policy.max_total_tokens is not None and n > policy.max_total_tokens:
        raise _too_long(what, n, policy.max_total_tokens, "the maximum total input length", "",
                        param)
    always = policy.mode == "chunk" and policy.chunk_above == "always"
    if n <= (policy.window(max_len) if always else max_len):
        return InputPlan([ids], [n], truncated=False, dropped_tokens=0, chunks=1, input_tokens=n)
    if policy.mode == "reject":
        raise _too_long(what, n, max_len, "the model's maximum context length",
                        "; ask for truncation or chunking to embed it", param)
    pre, content, suf = special.split(ids)
    if policy.mode == "truncate":
        keep = max_len - len(pre) - len(suf)
        if keep < 1:
            raise InvalidParameterValue(f"max_len ({max_len}) leaves no room for content after "
                                        f"{len(pre) + len(suf)} special tokens", param="input")
        body = content[:keep] if policy.truncation_direction == "right" else content[-keep:]
        piece = [*pre, *body, *suf]
        return InputPlan([piece], [len(piece)], truncated=True,
                         dropped_tokens=len(content) - keep, chunks=1, input_tokens=n)
    return _chunk(pre, content, suf, policy.window(max_len), policy.chunk_overlap, n)


def _chunk(pre: tuple[int, ...], content: list[int], suf: tuple[int, ...], window: int,
           overlap: int, n: int) -> InputPlan:
    room = window - len(pre) - len(suf)  # content tokens per window
    if room <= overlap:
        raise InvalidParameterValue(
            f"chunk window of {window} tokens minus {len(pre) + len(suf)} special tokens leaves "
            f"{room} content tokens, not more than chunk_overlap ({overlap})", param="input")
    stride = room - overlap
    pieces: list[list[int]] = []
    start = 0
    while True:
        end = min(start + room, len(content))
        pieces.append([*pre, *content[start:end], *suf])
        if end == len(content):
            break
        start += stride
    return InputPlan(pieces, [len(p) for p in pieces], truncated=False, dropped_tokens=0,
                     chunks=len(pieces), input_tokens=n)


def merge(vectors: Sequence[np.ndarray], weights: Sequence[float], normalize: bool) -> np.ndarray:
    """Token-weighted mean of chunk vectors; unit L2 when the model normalises its vectors.

    Re-normalising matters: a mean of unit vectors is shorter than 1, and a client comparing it by
    dot product with single-piece vectors would get systematically smaller scores.
    """
    if len(vectors) != len(weights) or not vectors:
        raise ValueError(f"merge needs one weight per vector; got {len(vectors)} vectors and "
                         f"{len(weights)} weights")
    mat = np.stack([np.asarray(v, dtype=np.float64) for v in vectors])
    w = np.asarray(weights, dtype=np.float64)
    if (w <= 0).any():
        raise ValueError(f"merge weights must be positive; got {list(weights)}")
    out = (w[:, None] * mat).sum(axis=0) / w.sum()
    if normalize:
        out = _unit(out)
    return out.astype(np.float32)


def _unit(vec: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(vec))
    return vec / norm if norm > 0 else vec


def check_dimensions(dims: int | None, hidden_size: int, matryoshka_dims: Sequence[int] | None,
                     *, any_up_to_hidden: bool = False, model: str = "this model") -> None:
    """Validate a request's ``dimensions`` before any work is done (same rules as
    ``apply_dimensions``), so a bad value is a 400 and not wasted engine time."""
    if dims is None:
        return
    if not matryoshka_dims and not any_up_to_hidden:
        raise UnsupportedParameter(
            f"model '{model}' does not support 'dimensions' (it declares no Matryoshka "
            f"dimensions); it always returns {hidden_size}-d vectors", param="dimensions")
    if dims > hidden_size:
        raise InvalidParameterValue(f"dimensions={dims} is larger than model '{model}''s "
                                    f"{hidden_size}-d vectors", param="dimensions")
    if matryoshka_dims and dims not in matryoshka_dims:
        raise InvalidParameterValue(
            f"dimensions={dims} is not one of model '{model}''s Matryoshka dimensions "
            f"{sorted(matryoshka_dims)}", param="dimensions")


def apply_dimensions(vec: np.ndarray, dims: int | None, matryoshka_dims: Sequence[int] | None,
                     *, any_up_to_hidden: bool = False, normalize: bool = True,
                     model: str = "this model") -> np.ndarray:
    """Truncate to ``dims`` and re-normalise, where the model declares Matryoshka dimensions.

    ``matryoshka_dims`` are the declared sizes; ``any_up_to_hidden`` is for models that are
    Matryoshka-trained without a list (vLLM's ``is_matryoshka`` alone). Apply it to the merged
    vector, not to each chunk: truncating then merging differs from merging then truncating.
    """
    check_dimensions(dims, len(vec), matryoshka_dims, any_up_to_hidden=any_up_to_hidden,
                     model=model)
    if dims is None or dims == len(vec):
        return vec
    out = np.asarray(vec[:dims], dtype=np.float64)
    return (_unit(out) if normalize else out).astype(np.float32)


def flatten(plans: Sequence[InputPlan]) -> list[list[int]]:
    """Every piece of every plan, in order: one engine call (or batcher call) for a request."""
    return [piece for p in plans for piece in p.pieces]


def merge_planned(plans: Sequence[InputPlan], vectors: Sequence[np.ndarray],
                  normalize: bool) -> list[np.ndarray]:
    """One vector per input from the vectors of ``flatten(plans)``; single pieces pass through."""
    total = sum(len(p.pieces) for p in plans)
    if len(vectors) != total:
        raise ValueError(f"{total} pieces planned but {len(vectors)} vectors returned")
    out: list[np.ndarray] = []
    k = 0
    for p in plans:
        vs = vectors[k:k + len(p.pieces)]
        k += len(p.pieces)
        out.append(vs[0] if len(vs) == 1 else merge(vs, p.weights, normalize))
    return out
