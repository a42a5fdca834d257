"""OpenAI embeddings API: request model, validation rules, response builder.

Validation happens here once, for every handler. ``parse_embedding_request`` turns a decoded JSON
body into an ``EmbeddingRequest`` or raises ``RequestValidation`` naming the offending ``param``.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import numpy as np
import orjson
from pydantic import (BaseModel, ConfigDict, Field, PositiveInt, ValidationError,
                      WithJsonSchema, field_validator)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from ..common.contracts import InputReport, Lane
from ..common.errors import RequestValidation, clip
from .pipeline import EmbedRequest

TokenIds = list[int]
# float and base64 are OpenAI's; the compact ones are sentence-transformers' (ingress/encodings.py)
EncodingFormat = Literal["float", "base64", "int8", "uint8", "binary", "ubinary"]
PARAM_LIMIT = 64  # an unknown parameter's name is the client's: error bodies carry at most this


def _bad(code: str, message: str) -> PydanticCustomError:
    return PydanticCustomError(code, message)


def normalize_input(value: Any) -> list[str] | list[TokenIds]:
    """OpenAI's four input shapes -> a list of texts or a list of token-id lists.

    A flat list of ints is one tokenised input (OpenAI's rule); a list of lists is many.
    """
    if isinstance(value, str):
        if not value:
            raise _bad("empty_input", "input must not be an empty string")
        return [value]
    if not isinstance(value, list):
        raise _bad("invalid_type", "input must be a string, a list of strings, a list of token "
                   f"ids or a list of token-id lists; got {type(value).__name__}")
    if not value:
        raise _bad("empty_input", "input must not be an empty list")
    kinds = {_item_kind(v) for v in value}
    if kinds == {"str"}:
        for i, v in enumerate(value):
            if not v:
                raise _bad("empty_input", f"input[{i}] is an empty string")
        return list(value)
    if kinds == {"int"}:
        _check_ids(value, "input")
        return [list(value)]
    if kinds == {"ids"}:
        for i, ids in enumerate(value):
            if not ids:
                raise _bad("empty_input", f"input[{i}] is an empty token list")
            _check_ids(ids, f"input[{i}]")
        return [list(v) for v in value]
    if "other" in kinds:
        bad = next(i for i, v in enumerate(value) if _item_kind(v) == "other")
        raise _bad("invalid_type", f"input[{bad}] has type {type(value[bad]).__name__}; items "
                   "must be strings, token ids (integers) or token-id lists")
    raise _bad("mixed_input", "input mixes item types "
               f"({', '.join(sorted(kinds))}); use one kind for all items")


def _item_kind(v: Any) -> str:
    if isinstance(v, str):
        return "str"
    if isinstance(v, int) and not isinstance(v, bool):
        return "int"
    if isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return "ids"
    return "other"


def _check_ids(ids: list[int], where: str) -> None:
    for j, t in enumerate(ids):
        if t < 0:
            raise _bad("invalid_token_id", f"{where}[{j}]={t}: token ids are non-negative")


# The four wire shapes of `input`, for the OpenAPI document: the field's own type is what
# ``normalize_input`` turns them into, which is not what a client sends.
_TEXT = {"type": "string", "minLength": 1}
_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
INPUT_JSON_SCHEMA = {
    "anyOf": [_TEXT, {"type": "array", "minItems": 1, "items": _TEXT}, _IDS,
              {"type": "array", "minItems": 1, "items": _IDS}],
    "description": "Text(s) or token ids to embed: a string, a list of strings, a list of token "
                   "ids (one input) or a list of token-id lists."}


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: Annotated[list[str] | list[TokenIds], WithJsonSchema(INPUT_JSON_SCHEMA)]
    model: str = Field(min_length=1)
    encoding_format: EncodingFormat = Field(
        default="float", description="float or base64 (OpenAI's), or a compact encoding applied "
        "to the final (truncated) vector as sentence-transformers' quantize_embeddings does: "
        "int8/uint8 by the model's per-dimension ranges (the x-embedfleet-int8-ranges header "
        "names them), binary/ubinary the signs packed 8 per byte.")
    dimensions: PositiveInt | None = None
    user: str | None = None
    # embedfleet extensions (the openai client sends them with `extra_body={...}`):
    long_input: Literal["reject", "truncate", "chunk"] | None = Field(
        default=None, description="Inputs over the model's context: refuse, cut, or split and "
        "merge. Default: the model's configured policy.")
    truncation_direction: Literal["right", "left"] | None = Field(
        default=None, description="With truncate: right keeps the beginning, left the end.")
    chunk_above: Literal["max_model_len", "always"] | None = Field(
        default=None, description="With chunk: split only inputs over the model's context "
        "(max_model_len), or every input longer than one chunk window (always, for documents). "
        "Default: the model's configured policy.")
    prompt_name: str | None = Field(
        default=None, description="Instruction template of the model to apply (e.g. 'query').")
    task: str | None = Field(default=None, description="Fills {task} in the template.")
    lane: Lane | None = Field(
        default=None, description="Priority lane: interactive (the default) is served ahead of "
        "bulk; bulk (corpus indexing) gets a guaranteed minimum share and 429 when its queue "
        "is full. Also the X-Embedfleet-Lane header.")

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> list[str] | list[TokenIds]:
        return normalize_input(v)

    @property
    def is_tokens(self) -> bool:
        return bool(self.input) and not isinstance(self.input[0], str)


# -- the response (documents what ``embedding_response`` builds; tests hold the two together) --
class EmbeddingData(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str | list[int] = Field(
        description="The vector; with encoding_format=base64, its little-endian float32 bytes; "
        "with int8/uint8, one integer per dimension; with binary/ubinary, its signs packed 8 "
        "to an integer (int8/uint8).")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Input tokens served from the prefix cache.")


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class InputNote(BaseModel):
    index: int
    truncated: bool
    dropped_tokens: int
    chunks: int
    input_tokens: int


class EmbedfleetNotes(BaseModel):
    inputs: list[InputNote] = Field(description="The inputs the long-input policy changed.")


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: Usage
    # absent rather than null when there is nothing to say: SkipJsonSchema keeps null out of the doc
    embedfleet: EmbedfleetNotes | SkipJsonSchema[None] = None


def parse_body(model: type[BaseModel], data: Any) -> Any:
    """A decoded JSON body -> ``model``, or ``RequestValidation`` naming the param (every API)."""
    if not isinstance(data, dict):
        raise RequestValidation(
            f"request body must be a JSON object; got {type(data).__name__}", param=None)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise validation_error(err) from None


def parse_embedding_request(data: Any) -> EmbeddingRequest:
    return parse_body(EmbeddingRequest, data)


def validation_error(err: ValidationError) -> RequestValidation:
    """The first pydantic error as an OpenAI-style error naming its parameter.

    What it echoes of the body goes through ``clip``: bounded in length, and in depth - the
    value may be JSON nested as deep as the parser allows (1,024 levels), deeper than any
    encoder or ``repr`` will follow.
    """
    e = err.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in e["loc"])
    top = str(e["loc"][0]) if e["loc"] else None
    if e["type"] == "missing":
        msg = f"'{loc}' is a required property"
    elif e["type"] == "extra_forbidden":  # the name is the client's: echo it bounded
        msg = f"unrecognized request argument supplied: {clip(loc)}"
        if top is not None and len(top) > PARAM_LIMIT:
            top = top[:PARAM_LIMIT] + "…"
    else:
        msg = f"invalid '{loc}': {e['msg']}"
        if e["type"].endswith("_type") or e["type"] == "literal_error":
            msg += f" (got {clip(e.get('input'))})"
    return RequestValidation(msg, param=top)


def encode_vector(vec: np.ndarray, encoding: EncodingFormat) -> Any:
    """One vector on the wire: base64 of the floats, else the array itself (floats, or the
    integers of a compact encoding, which ``ingress/encodings.py`` made)."""
    if encoding == "base64":
        # OpenAI's base64 format: little-endian float32 bytes.
        return base64.b64encode(np.ascontiguousarray(vec, dtype="<f4").tobytes()).decode()
    return vec


def embedding_response(vectors: np.ndarray | list[np.ndarray], *, model: str,
                       prompt_tokens: int, encoding: EncodingFormat, cached_tokens: int = 0,
                       inputs_report: tuple[InputReport, ...] | None = None) -> bytes:
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encode_vector(v, encoding)}
                 for i, v in enumerate(vectors)],
        "model": model,
        # prompt_tokens_details.cached_tokens: prefix-cache hits, as OpenAI reports them for chat.
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                  "prompt_tokens_details": {"cached_tokens": cached_tokens}},
    }
    if inputs_report is not None:
        # What the long-input policy did, for the inputs it changed (OpenAI clients ignore it).
        body["embedfleet"] = {"inputs": [
            {"index": r.index, "truncated": r.truncated, "dropped_tokens": r.dropped_tokens,
             "chunks": r.chunks, "input_tokens": r.input_tokens}
            for r in inputs_report if r.truncated or r.chunks > 1]}
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def to_pipeline(req: EmbeddingRequest, lane: Lane = "interactive") -> EmbedRequest:
    return EmbedRequest(model=req.model, inputs=req.input, param="input",
                        dimensions=req.dimensions, long_input_mode=req.long_input,
                        truncation_direction=req.truncation_direction,
                        chunk_above=req.chunk_above,
                        prompt_name=req.prompt_name, task=req.task, lane=lane)
