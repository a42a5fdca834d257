"""Cohere-compatible ``POST /v2/embed``: request model, translation, response builder.

Shapes follow Cohere's Embed API v2: ``model``, ``texts``, ``input_type``, ``embedding_types``
(several at once), ``truncate`` (``NONE``/``START``/``END``) and ``output_dimension``; the answer
is ``{"id", "embeddings": {"float": [...], "int8": [...], ...}, "texts", "meta"}``, one list per
asked type, in input order. It runs the same pipeline as ``/v1/embeddings`` and ``/embed`` and
the same quantiser (``ingress/encodings.py``), so a vector's int8 form is the same on every route.

Where embedfleet differs, on purpose:

* ``input_type``: ``search_query`` applies the model's ``query`` prompt template when it has one
  (Qwen3-Embedding's instruction); the other types embed the text as it is (or with the model's
  default prompt). Image inputs (``image``, ``images``, ``inputs``) are not served: 422.
* ``truncate`` absent means the model's configured long-input policy (which may chunk), as on
  ``/embed``; ``END`` cuts the end (keeps the beginning), ``START`` the beginning, ``NONE``
  refuses an over-long text with a 400.
* ``base64`` is not one of the accepted ``embedding_types``; errors use embedfleet's one error
  body; ``lane`` is an embedfleet extension, as on the other routes.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator
from pydantic_core import PydanticCustomError

from ..common.contracts import Lane
from ..config.schema import ModelConfig
from .openai import parse_body
from .pipeline import EmbedRequest

EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary"]
InputType = Literal["search_document", "search_query", "classification", "clustering"]
QUERY_PROMPT = "query"  # the template name search_query applies, where the model has it
_TRUNCATE = {"NONE": ("reject", None), "START": ("truncate", "left"),
             "END": ("truncate", "right"), None: (None, None)}


class CohereEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    texts: list[str] = Field(min_length=1, description="The texts to embed (non-empty "
                             "strings).")
    input_type: InputType = Field(description="search_query applies the model's query prompt, "
                                  "where it has one; the others embed the text as it is.")
    embedding_types: list[EmbeddingType] = Field(
        default=["float"], min_length=1, description="The encodings to return, one list each: "
        "float, or int8/uint8 (by the model's per-dimension ranges), binary/ubinary (signs "
        "packed 8 per integer), as sentence-transformers' quantize_embeddings.")
    truncate: Literal["NONE", "START", "END"] | None = Field(
        default=None, description="Over-long texts: NONE refuses, START cuts the beginning, END "
        "the end; absent: the model's long-input policy.")
    output_dimension: PositiveInt | None = Field(
        default=None, description="Matryoshka truncation (the model's dimensions).")
    lane: Lane | None = Field(default=None, description="embedfleet extension: the priority "
                              "lane, as on /v1/embeddings.")

    @field_validator("texts", mode="before")
    @classmethod
    def _texts(cls, v: Any) -> list[str]:
        if not isinstance(v, list) or not v:
            raise PydanticCustomError("invalid_type", "texts must be a non-empty list of "
                                      f"strings; got {type(v).__name__}")
        for i, t in enumerate(v):
            if not isinstance(t, str) or not t:
                raise PydanticCustomError("invalid_type",
                                          f"texts[{i}] must be a non-empty string")
        return list(v)


def parse_cohere_embed_request(data: Any) -> CohereEmbedRequest:
    """Decoded JSON -> ``CohereEmbedRequest``, or ``RequestValidation`` (422) naming the param."""
    return parse_body(CohereEmbedRequest, data)


def cohere_to_pipeline(req: CohereEmbedRequest, m: ModelConfig,
                       lane: Lane = "interactive") -> EmbedRequest:
    mode, direction = _TRUNCATE[req.truncate]
    prompt = (QUERY_PROMPT if req.input_type == "search_query" and m.prompts is not None
              and QUERY_PROMPT in m.prompts.templates else None)
    return EmbedRequest(model=req.model, inputs=req.texts, param="texts",
                        dimensions=req.output_dimension, long_input_mode=mode,
                        truncation_direction=direction, prompt_name=prompt, lane=lane)


# -- the response (documents what ``cohere_embed_response`` builds) ----------------------------
class CohereEmbeddings(BaseModel):
    float_: list[list[float]] | None = Field(default=None, alias="float")
    int8: list[list[int]] | None = None
    uint8: list[list[int]] | None = None
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None


class CohereApiVersion(BaseModel):
    version: str


class CohereBilledUnits(BaseModel):
    input_tokens: int


class CohereMeta(BaseModel):
    api_version: CohereApiVersion
    billed_units: CohereBilledUnits


class CohereEmbedResponse(BaseModel):
    id: str
    response_type: Literal["embeddings_by_type"]
    embeddings: CohereEmbeddings = Field(description="One list per asked type, in input order.")
    texts: list[str]
    meta: CohereMeta


def cohere_embed_response(request_id: str, texts: list[str], arrays: dict[str, np.ndarray],
                          prompt_tokens: int) -> bytes:
    """Cohere's ``EmbedByTypeResponse``: each asked encoding's vectors under its name."""
    body = {"id": request_id, "response_type": "embeddings_by_type",
            "embeddings": {name: (a.astype(np.float32, copy=False) if name == "float" else a)
                           for name, a in arrays.items()},
            "texts": texts,
            "meta": {"api_version": {"version": "2"},
                     "billed_units": {"input_tokens": prompt_tokens}}}
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
