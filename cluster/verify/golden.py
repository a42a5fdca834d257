"""Golden files of `embedfleet verify`: corpus vectors and fingerprints saved by --save-golden and
read back by --golden, so vectors can be compared across platforms and releases.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .client import FINGERPRINT_KEYS, VerifyUsageError

GOLDEN_FORMAT = "embedfleet-golden/1"


@dataclass
class GoldenEntry:
    texts: list[str]
    vectors: np.ndarray
    fingerprint: dict[str, str]


def save_golden(path: Path, entries: dict[str, GoldenEntry], source: str) -> None:
    """JSON (readable, diffable) or .npz (compact); the model name keys each entry."""
    meta: dict[str, Any] = {"format": GOLDEN_FORMAT, "source": source,
                            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                            "models": {}}
    arrays = {}
    for i, (name, e) in enumerate(entries.items()):
        entry = {"texts": e.texts, "fingerprint": e.fingerprint}
        if path.suffix == ".npz":
            entry["array"] = f"vectors_{i}"
            arrays[entry["array"]] = np.asarray(e.vectors, np.float32)
        else:
            entry["vectors"] = np.asarray(e.vectors, np.float32).tolist()
        meta["models"][name] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".npz":
        with path.open("wb") as f:
            np.savez_compressed(f, meta=np.array(json.dumps(meta)), **arrays)
    else:
        path.write_text(json.dumps(meta, ensure_ascii=False))


def load_golden(path: Path) -> dict[str, GoldenEntry]:
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                arrays = {k: z[k] for k in z.files if k != "meta"}
        else:
            meta, arrays = json.loads(path.read_text()), {}
        if meta.get("format") != GOLDEN_FORMAT:
            raise ValueError(f"format is {meta.get('format')!r}, expected {GOLDEN_FORMAT!r}")
        out = {}
        for name, e in meta["models"].items():
            vectors = np.asarray(arrays[e["array"]] if "array" in e else e["vectors"], np.float32)
            if vectors.ndim != 2 or len(vectors) != len(e["texts"]):
                raise ValueError(f"model {name}: {len(e['texts'])} texts but vectors of shape "
                                 f"{vectors.shape}")
            out[name] = GoldenEntry(list(e["texts"]), vectors, dict(e.get("fingerprint") or {}))
        return out
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise VerifyUsageError(f"golden file {path}: {exc}") from None


def fingerprint_diff(saved: dict[str, str], now: dict[str, str]) -> list[str]:
    short = {k: k.removeprefix("x-embedfleet-") for k in FINGERPRINT_KEYS}
    return [f"{short.get(k, k)} {saved.get(k, '?')} → {now.get(k, '?')}"
            for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
