"""TEI-compatible API: ``POST /embed`` and ``POST /tokenize`` request models and response builders.

Shapes follow Hugging Face text-embeddings-inference (``router/src/http/types.rs``): ``/embed``
takes ``inputs`` (a string or a list of strings), ``truncate``, ``truncation_direction`` (TEI
spells it ``Right``/``Left``; lower case is accepted too), ``normalize`` (default true),
``dimensions`` and ``prompt_name``, and answers a bare JSON list of vectors. ``/tokenize``
answers, per input, a list of ``{"id", "text", "special", "start", "stop"}`` built from the
tokenizer's character offsets: special tokens carry their token string and null offsets, other
tokens the slice of the input they cover - as TEI does.

Where embedfleet differs, on purpose:

* ``truncate`` absent or null means "the model's configured long-input policy" - TEI's own rule
  (null falls back to the server's ``--auto-truncate``), and that policy may be ``chunk``.
  ``truncate: true`` truncates in ``truncation_direction``; ``truncate: false`` rejects an input
  longer than the model with a **400** (``InputTooLong``, naming the input's length and the limit),
  not TEI's 413: 413 means "body too large" everywhere else in embedfleet, and one status per cause
  is the errors module's rule.
* Errors use embedfleet's one error body (``{"error": {"message", "type", "param", "code"}}``),
  not TEI's ``{"error", "error_type"}``; validation errors are 422 naming the parameter, as on
  ``/v1/embeddings``.
* ``model`` (optional) picks the served model, since embedfleet serves several and TEI one;
  absent means the configured default model.
* Token-id ``inputs`` (which newer TEI accepts) are refused with a message pointing at
  ``/v1/embeddings``, which takes them.
* ``encoding_format`` (an extension; TEI refuses compact vectors) gives int8, uint8, binary or
  ubinary vectors as on ``/v1/embeddings`` (``ingress/encodings.py``); with ``normalize: false``
  int8/uint8 use ranges measured in that unnormalised space.
* The bare-list response has no room for per-input notes, so what the long-input policy did is in
  response headers (``x-embedfleet-truncated-inputs``, ``x-embedfleet-chunked-inputs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import numpy as np
import orjson
from pydantic import (BaseModel, ConfigDict, PositiveInt, RootModel, WithJsonSchema,
                      field_validator)
from pydantic_core import PydanticCustomError

from ..common.contracts import Lane, SimpleToken
from ..common.long_input import ChunkAbove, TruncationDirection
from .openai import parse_body
from .pipeline import EmbedRequest


# /v1/embeddings' encodings less base64 (TEI's answer is a list of number lists)
TeiEncoding = Literal["float", "int8", "uint8", "binary", "ubinary"]


def _bad(code: str, message: str) -> PydanticCustomError:
    return PydanticCustomError(code, message)


def normalize_tei_inputs(value: Any) -> list[str]:
    """TEI's ``inputs``: one string or a non-empty list of non-empty strings -> list of strings."""
    if isinstance(value, str):
        if not value:
            raise _bad("empty_input", "inputs must not be an empty string")
        return [value]
    if not isinstance(value, list):
        raise _bad("invalid_type", "inputs must be a string or a list of strings; got "
                   f"{type(value).__name__}")
    if not value:
        raise _bad("empty_input", "inputs must not be an empty list")
    for i, v in enumerate(value):
        if isinstance(v, str):
            if not v:
                raise _bad("empty_input", f"inputs[{i}] is an empty string")
            continue
        if isinstance(v, int) or (isinstance(v, list) and v and all(isinstance(t, int) for t in v)):
            raise _bad("invalid_type", "token-id inputs are not accepted on this route; send "
                       "them to /v1/embeddings as 'input'")
        raise _bad("invalid_type", f"inputs[{i}] has type {type(v).__name__}; items must be "
                   "strings")
    return list(value)


def _direction(value: Any) -> Any:
    # TEI's serde enum is spelled "Right"/"Left"; HF's tokenizers and embedfleet use lower case.
    return value.lower() if isinstance(value, str) and value.lower() in ("right", "left") else value


# The wire shapes, for the OpenAPI document (the fields' types are what the validators make of
# them): one text or a list of texts, and TEI's capitalised spelling of the direction.
_TEXT = {"type": "string", "minLength": 1}
INPUTS_JSON_SCHEMA = {"anyOf": [_TEXT, {"type": "array", "minItems": 1, "items": _TEXT}],
                      "description": "Text(s): a string or a list of strings."}
DIRECTION_JSON_SCHEMA = {"enum": ["right", "left", "Right", "Left"], "default": "right",
                         "description": "right keeps the beginning, left the end."}
TeiInputs = Annotated[list[str], WithJsonSchema(INPUTS_JSON_SCHEMA)]


class TeiEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: TeiInputs
    truncate: bool | None = None
    """True: truncate; False: reject over-long inputs (400); None: the model's long-input policy."""
    truncation_direction: Annotated[TruncationDirection,
                                    WithJsonSchema(DIRECTION_JSON_SCHEMA)] = "right"
    normalize: bool = True
    dimensions: PositiveInt | None = None
    prompt_name: str | None = None
    model: str | None = None
    """embedfleet extension: which served model; None = the default model."""
    lane: Lane | None = None
    """embedfleet extension: the priority lane (as on /v1/embeddings); None = interactive."""
    chunk_above: ChunkAbove | None = None
    """embedfleet extension: with a model whose policy chunks, split every input longer than one
    window (always) or only those over its context (max_model_len); None = the model's policy."""
    encoding_format: TeiEncoding = "float"
    """embedfleet extension (TEI has none): the vectors as floats, or compact as on
    /v1/embeddings (int8/uint8 by the model's ranges, binary/ubinary packed signs), applied
    after ``dimensions``; each vector is then a list of integers."""

    @field_validator("inputs", mode="before")
    @classmethod
    def _inputs(cls, v: Any) -> list[str]:
        return normalize_tei_inputs(v)

    @field_validator("truncation_direction", mode="before")
    @classmethod
    def _truncation_direction(cls, v: Any) -> Any:
        return _direction(v)


class TeiTokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: TeiInputs
    add_special_tokens: bool = True
    prompt_name: str | None = None
    model: str | None = None
    """embedfleet extension: which served model; None = the default model."""

    @field_validator("inputs", mode="before")
    @classmethod
    def _inputs(cls, v: Any) -> list[str]:
        return normalize_tei_inputs(v)


def tei_to_pipeline(req: TeiEmbedRequest, model: str,
                    lane: Lane = "interactive") -> EmbedRequest:
    """TEI's ``truncate`` (true: truncate, false: reject, absent: the model's policy) and
    ``truncation_direction`` as the pipeline's long-input overrides."""
    mode = {True: "truncate", False: "reject", None: None}[req.truncate]
    direction = (req.truncation_direction if "truncation_direction" in req.model_fields_set
                 else None)
    return EmbedRequest(model=model, inputs=req.inputs, param="inputs",
                        dimensions=req.dimensions, long_input_mode=mode,
                        truncation_direction=direction, chunk_above=req.chunk_above,
                        prompt_name=req.prompt_name,
                        normalize=req.normalize, lane=lane)


def parse_tei_embed_request(data: Any) -> TeiEmbedRequest:
    """Decoded JSON -> ``TeiEmbedRequest``, or ``RequestValidation`` (422) naming the param."""
    return parse_body(TeiEmbedRequest, data)


def parse_tei_tokenize_request(data: Any) -> TeiTokenizeRequest:
    """Decoded JSON -> ``TeiTokenizeRequest``, or ``RequestValidation`` (422) naming the param."""
    return parse_body(TeiTokenizeRequest, data)


# -- responses -------------------------------------------------------------------------------
class TeiEmbedResponse(RootModel[list[list[float]]]):
    """One vector per input, in input order (documents ``tei_embed_response``); integers with
    a compact ``encoding_format``."""


def tei_embed_response(vectors: Sequence[np.ndarray] | np.ndarray) -> bytes:
    """TEI's ``EmbedResponse``: a JSON list of float lists (or of integer lists, for a compact
    encoding), in input order."""
    return orjson.dumps([v if np.asarray(v).dtype.kind in "iu" else np.asarray(v, np.float32)
                         for v in vectors], option=orjson.OPT_SERIALIZE_NUMPY)


class TeiTokenizeResponse(RootModel[list[list[SimpleToken]]]):
    """One token list per input, in input order (documents ``tei_tokenize_response``)."""


def tei_tokenize_response(tokens: Sequence[Sequence[SimpleToken]]) -> bytes:
    """TEI's ``TokenizeResponse``: one token list per input, in input order."""
    return orjson.dumps([list(t) for t in tokens])
