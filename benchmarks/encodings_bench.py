"""Bytes per vector of each ``encoding_format``, measured from embedfleet's own answers.

What a vector store keeps per vector is a property of the dimension count and the encoding: 4
bytes a dimension as float, 1 as int8/uint8, 1 per 8 dimensions as binary/ubinary. The bench
does not compute it from that rule: it asks ``/v1/embeddings`` for the same texts in every
encoding and measures what came back - the values of each vector held in the encoding's own
type (base64: its decoded bytes) - and the JSON the client received, per vector. A wrong
encoding (a vector of the wrong length, floats where integers belong) shows in the figures.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

ENCODINGS = ("float", "base64", "int8", "uint8", "binary", "ubinary")
# each encoding's values as a vector store keeps them
STORED = {"float": np.float32, "int8": np.int8, "uint8": np.uint8, "binary": np.int8,
          "ubinary": np.uint8}


def stored_bytes(encoding: str, value: Any) -> int:
    """One answered vector's size as stored: base64's decoded bytes, else its values held in
    the encoding's type (which refuses values outside it: an int8 answer of 200 raises)."""
    if encoding == "base64":
        return len(base64.b64decode(value))
    values = np.asarray(value)
    if encoding != "float" and not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"{encoding}: the answer holds non-integers ({values.dtype})")
    info = np.iinfo(STORED[encoding]) if encoding != "float" else None
    if info is not None and (values.min() < info.min or values.max() > info.max):
        raise ValueError(f"{encoding}: values outside {info.dtype}")
    return values.astype(STORED[encoding]).nbytes


async def measure_encodings(url: str, model: str, texts: list[str], timeout_s: float = 240,
                            transport: Any = None) -> dict[str, Any]:
    """Each encoding's bytes per vector for ``texts`` (one request each), from the answers.
    ``transport``: httpx's, for an app served in process (tests)."""
    import httpx

    per: dict[str, Any] = {}
    headers: dict[str, str] = {}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s,
                                     transport=transport) as client:
            for enc in ENCODINGS:
                r = await client.post("/v1/embeddings", json={
                    "model": model, "input": texts, "encoding_format": enc})
                r.raise_for_status()
                data = r.json()["data"]
                sizes = [stored_bytes(enc, d["embedding"]) for d in data]
                per[enc] = {"bytes_per_vector": int(np.median(sizes)),
                            "min_bytes": min(sizes), "max_bytes": max(sizes),
                            "json_bytes_per_vector": round(len(r.content) / len(data), 1)}
                if enc == "float":
                    per[enc]["dimensions"] = len(data[0]["embedding"])
                if "x-embedfleet-int8-ranges" in r.headers:
                    headers["int8_ranges"] = r.headers["x-embedfleet-int8-ranges"]
    except Exception as exc:  # noqa: BLE001 - the report says why, the bench goes on
        return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:300],
                "model": model, "texts": len(texts)}
    return {"status": "ok", "model": model, "texts": len(texts),
            "dimensions": per["float"]["dimensions"], "per_encoding": per, **headers}


def encodings_lines(section: dict[str, Any] | None) -> list[str]:
    """The report's line: bytes per vector of each encoding, as stored and as JSON."""
    if not section:
        return []
    if section.get("status") != "ok":
        return [f"bytes per vector: {section.get('status')}: {section.get('reason')}"]
    per = section["per_encoding"]
    stored = ", ".join(f"{e} {per[e]['bytes_per_vector']:,}" for e in per)
    wire = ", ".join(f"{e} {per[e]['json_bytes_per_vector']:,.0f}" for e in per)
    return [f"bytes per vector ({section['model']}, {section['dimensions']}-d, measured on "
            f"{section['texts']} texts): stored {stored}; JSON {wire}"]
