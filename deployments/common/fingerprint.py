"""The fingerprint every embeddings response carries, so a vector store can detect drift.

A vector is only comparable with vectors made by the same weights, dtype, engine and cache
behaviour. The model digest hashes the model's ``config.json`` and the header of each safetensors
file (tensor names, dtypes, shapes and offsets: the weights index) — cheap to read, and it changes
whenever the checkpoint does.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

HEADER_PREFIX = "x-embedfleet-"


def model_digest(model_dir: str | Path) -> str:
    root = Path(model_dir)
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json", "modules.json"):
        p = root / name
        if p.exists():
            h.update(name.encode() + b"\0" + p.read_bytes())
    for st in sorted(root.glob("*.safetensors")):
        with st.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            h.update(st.name.encode() + b"\0" + f.read(min(n, 64 << 20)))
    return h.hexdigest()[:16]


def safetensors_bytes(model_dir: str | Path) -> int | None:
    """Bytes of every tensor in the folder's safetensors files (from their headers); None when
    the folder holds none."""
    import json

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for st in files:
        with st.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        total += sum(end - start for name, t in header.items() if name != "__metadata__"
                     for start, end in [t["data_offsets"]])
    return total


def weights_bytes(source) -> int | None:
    """The weights' size for a config ``ModelSource``, when they are on this machine."""
    try:
        return safetensors_bytes(source.local_dir())
    except Exception:  # a hub id not in the local cache, a missing package: unknown here
        return None
