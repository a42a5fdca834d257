"""Compact encodings of the final vectors: int8, uint8, binary, ubinary (one quantiser, every API).

Conventions are sentence-transformers' ``quantize_embeddings``, so vectors stored from embedfleet
compare with vectors quantised there:

* ``ubinary``: ``packbits(v > 0)`` per vector, uint8 (d/8 bytes);
* ``binary``: the same bytes minus 128, as int8;
* ``uint8``: each dimension bucketed over its [min, max] range into 256 steps,
  ``floor((v - min) / ((max - min) / 255))`` clipped to [0, 255]; ``int8``: the same minus 128.
  A value outside its range lands in the end bucket.

Where: in the ingress, on the request's final vectors - after the pipeline has merged a large
request's slices and a long input's chunks and applied Matryoshka truncation - so a vector's
encoding never depends on how it was sliced or chunked. It is one vectorised numpy pass over the
whole batch.

The int8/uint8 ranges belong to the model and the output's dimension count (and to
normalize=false on TEI, a different space), never to the request's own batch (a vector would
depend on its neighbours). They come from the model's ``encodings.int8_ranges_file`` or, failing
that, are measured once per ingress by embedding the shipped calibration texts
(``calibration_texts.py``) through the same pipeline. Which ranges were used travels in the
``x-embedfleet-int8-ranges`` header: their source and a digest of their values.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import numpy as np

from ..common.errors import InternalError
from .calibration_texts import CALIBRATION_TEXTS
from .pipeline import EmbedPipeline, EmbedRequest

logger = logging.getLogger("embedfleet.encodings")

Compact = Literal["int8", "uint8", "binary", "ubinary"]
COMPACT: tuple[str, ...] = get_args(Compact)
RANGED = ("int8", "uint8")
RANGES_HEADER = "x-embedfleet-int8-ranges"


def quantize(vectors: np.ndarray, encoding: Compact, ranges: np.ndarray | None = None
             ) -> np.ndarray:
    """``vectors`` (n, d) float -> (n, d) int8/uint8, or (n, ceil(d/8)) for the binary kinds.
    ``ranges``: (2, d) per-dimension [min; max], for int8 and uint8 only."""
    v = np.asarray(vectors)
    if v.ndim != 2:
        raise ValueError(f"quantize wants a (vectors, dimensions) array, got shape {v.shape}")
    if encoding in ("binary", "ubinary"):
        bits = np.packbits(v > 0, axis=-1)  # per row: a row's bits never spill into the next
        return bits if encoding == "ubinary" else (bits.astype(np.int16) - 128).astype(np.int8)
    if encoding not in RANGED:
        raise ValueError(f"unknown compact encoding {encoding!r}")
    if ranges is None or ranges.shape != (2, v.shape[1]):
        raise ValueError(f"{encoding} needs (2, {v.shape[1]}) ranges, got "
                         f"{None if ranges is None else ranges.shape}")
    r = ranges.astype(np.float32, copy=False)
    steps = (r[1] - r[0]) / 255
    steps = np.where(steps == 0, 1, steps)  # a constant dimension: every value in bucket 0
    buckets = np.clip(np.floor((v - r[0]) / steps), 0, 255)
    return buckets.astype(np.uint8) if encoding == "uint8" else (buckets - 128).astype(np.int8)


@dataclass(frozen=True, slots=True)
class Ranges:
    values: np.ndarray  # (2, d) float32: mins, maxs
    source: str  # "config" or "calibration"

    @property
    def label(self) -> str:
        """What the header says: the source and a digest of the values themselves."""
        digest = hashlib.sha256(np.ascontiguousarray(self.values, "<f4").tobytes()).hexdigest()
        return f"{self.source}:{digest[:16]}"


def ranges_of(vectors: np.ndarray) -> np.ndarray:
    """Per-dimension [min; max] of calibration vectors, (2, d) float32."""
    v = np.asarray(vectors, dtype=np.float32)
    return np.stack([v.min(axis=0), v.max(axis=0)])


def load_ranges_file(path: str | Path) -> dict[int, np.ndarray]:
    """``encodings.int8_ranges_file``: ``{"<d>": [[min...], [max...]]}`` -> {d: (2, d) array}.
    Raises ValueError naming what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{path}: want an object {{\"<dimensions>\": [[min...], [max...]]}}")
    out: dict[int, np.ndarray] = {}
    for key, value in data.items():
        if not str(key).isdigit():
            raise ValueError(f"{path}: key {key!r} is not a dimension count")
        d = int(key)
        try:
            arr = np.asarray(value, dtype=np.float32)
        except (TypeError, ValueError):
            raise ValueError(f"{path}: ranges for {d} are not numbers") from None
        if arr.shape != (2, d):
            raise ValueError(f"{path}: ranges for {d} have shape {arr.shape}, want (2, {d})")
        if not np.all(np.isfinite(arr)) or np.any(arr[1] < arr[0]):
            raise ValueError(f"{path}: ranges for {d} must be finite with min <= max")
        out[d] = arr
    return out


# What the calibration embeds: (model, dimensions, normalize) -> the vectors of CALIBRATION_TEXTS
Calibrate = Callable[[str, int | None, bool], Awaitable[np.ndarray]]


class RangesBook:
    """The int8/uint8 ranges an ingress uses, per (model, dimensions, normalize): from the
    model's ranges file when it has them for the output's size, else measured once from the
    calibration texts (one engine call per key, shared by concurrent requests; a failure is not
    kept, so the next request tries again)."""

    def __init__(self, ranges_file: Callable[[str], str | None], calibrate: Calibrate) -> None:
        self._ranges_file = ranges_file
        self._calibrate = calibrate
        self._files: dict[str, dict[int, np.ndarray]] = {}
        self._measured: dict[tuple[str, int | None, bool], asyncio.Future] = {}

    def preload(self, models: list[str]) -> None:
        """Read every model's ranges file now, at the ingress's start: a file that cannot be
        read stops the ingress replica from starting (its reason in Serve's status), never a
        500 on the first int8 request."""
        for model in models:
            if (path := self._ranges_file(model)) is not None and model not in self._files:
                try:
                    self._files[model] = load_ranges_file(path)
                except ValueError as err:
                    raise ValueError(f"model '{model}': encodings.int8_ranges_file: {err}") \
                        from None

    def _from_file(self, model: str, d: int) -> Ranges | None:
        path = self._ranges_file(model)
        if path is None:
            return None
        if model not in self._files:
            try:
                self._files[model] = load_ranges_file(path)
            except ValueError as err:  # the operator's file, not the client's input
                logger.error("model %s: encodings.int8_ranges_file: %s", model, err)
                raise InternalError(f"model '{model}': its configured int8 ranges cannot be "
                                    "read; see the server log") from None
        found = self._files[model].get(d)
        return None if found is None else Ranges(found, "config")

    async def get(self, model: str, dimensions: int | None, normalize: bool, d: int) -> Ranges:
        """The ranges for ``d``-dimensional output vectors of a request that asked for
        ``dimensions`` (None: the model's size) and ``normalize``."""
        if normalize and (ranges := self._from_file(model, d)) is not None:
            return ranges
        key = (model, dimensions, normalize)
        fut = self._measured.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_task(self._measure(model, dimensions,
                                                                       normalize))
            fut.add_done_callback(lambda f: self._forget_failed(key, f))
            self._measured[key] = fut
        # shielded: a waiter that goes away (its client did) leaves the measurement to the others
        ranges = await asyncio.shield(fut)
        if ranges.values.shape[1] != d:  # cannot happen unless the model changed under us
            raise InternalError(f"model '{model}': calibration gave {ranges.values.shape[1]}-d "
                                f"vectors for a {d}-d request")
        return ranges

    def _forget_failed(self, key: tuple[str, int | None, bool], fut: asyncio.Future) -> None:
        """A failed or cancelled measurement is not kept: the next request measures again."""
        if (fut.cancelled() or fut.exception() is not None) and self._measured.get(key) is fut:
            del self._measured[key]

    async def _measure(self, model: str, dimensions: int | None, normalize: bool) -> Ranges:
        vectors = await self._calibrate(model, dimensions, normalize)
        ranges = Ranges(ranges_of(vectors), "calibration")
        logger.info("model %s: int8 ranges for dimensions=%s normalize=%s measured from %d "
                    "calibration texts (%s)", model, dimensions, normalize, len(vectors),
                    ranges.label)
        return ranges


@dataclass(frozen=True, slots=True)
class Encoded:
    arrays: dict[str, np.ndarray]  # encoding -> (n, ...) array; float/base64 -> the float vectors
    headers: dict[str, str]


class Encoder:
    """Turns a request's final float vectors into each encoding it asked for."""

    def __init__(self, book: RangesBook) -> None:
        self.book = book

    async def encode(self, model: str, vectors: np.ndarray, encodings: Sequence[str], *,
                     dimensions: int | None, normalize: bool = True) -> Encoded:
        arrays: dict[str, np.ndarray] = {}
        headers: dict[str, str] = {}
        for enc in dict.fromkeys(encodings):
            if enc not in COMPACT:
                arrays[enc] = vectors
                continue
            ranges = None
            if enc in RANGED:
                ranges = await self.book.get(model, dimensions, normalize, vectors.shape[1])
                headers[RANGES_HEADER] = ranges.label
            arrays[enc] = quantize(vectors, enc, None if ranges is None else ranges.values)
        return Encoded(arrays, headers)


def encoder_for(pipeline: EmbedPipeline) -> Encoder:
    """The ingress's encoder: ranges from each model's config, else calibrated through
    ``pipeline`` - the same replicas, long-input policy and default prompt as any request."""

    async def calibrate(model: str, dimensions: int | None, normalize: bool) -> np.ndarray:
        # in requests no larger than a client's may be (router.max_inputs_per_request)
        step = pipeline.cfg.router.max_inputs_per_request
        texts = list(CALIBRATION_TEXTS)
        parts = []
        for i in range(0, len(texts), step):
            req = EmbedRequest(model=model, inputs=texts[i:i + step], param="calibration",
                               dimensions=dimensions, normalize=normalize)
            parts.append((await pipeline.run(req, f"calib-{uuid.uuid4().hex[:16]}")).vectors)
        return np.concatenate(parts)

    def ranges_file(model: str) -> str | None:
        return pipeline.resolve(model).encodings.int8_ranges_file

    book = RangesBook(ranges_file, calibrate)
    book.preload([m.name for m in pipeline.cfg.models])
    return Encoder(book)
