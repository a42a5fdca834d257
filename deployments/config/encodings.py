"""A model's ``encodings`` section: where the int8/uint8 ranges of its compact encodings come from.

Kept apart from the rest of the schema (``config/schema.py``) because only the ingress reads it
(``ingress/encodings.py``). int8 and uint8 bucket each dimension over a [min, max] range; those
ranges are a property of the model (and of the output dimension count), never of one request's
batch, or a vector would depend on its neighbours.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EncodingsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)  # as every section of the config

    int8_ranges_file: str | None = Field(
        default=None, description="A JSON file of per-dimension ranges for the int8 and uint8 "
        "encodings, keyed by the vector's dimension count: {\"384\": [[min, ...], [max, ...]]} "
        "(sentence-transformers' `ranges`, shape (2, d), of L2-normalised vectors). Each ingress "
        "reads it on its own node when it starts (a file it cannot read stops it from "
        "starting), so every ingress quantises with the same "
        "numbers. None, or a dimension count the file lacks, or normalize=false: ranges "
        "measured once per ingress from the calibration texts shipped with the code.")
