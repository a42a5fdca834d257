"""The cluster side of `embedfleet verify`: the OpenAI embeddings API over HTTP, and its errors.

The checks talk to an ``EmbeddingsClient``, so the unit tests can put a fake server behind it.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import numpy as np

from ...deployments.common.contracts import Fingerprint

# The fingerprint header names, from the contract that sets them (not the per-request counts).
FINGERPRINT_KEYS = tuple(Fingerprint("", "", "", "", False).headers())


class VerifyUsageError(Exception):
    """The command cannot run as asked (exit code 2)."""


class ServerError(Exception):
    """The cluster answered an embeddings request with an error, or not at all."""


@dataclass(frozen=True)
class Embedded:
    vectors: np.ndarray  # (texts, dims) float32, in input order
    prompt_tokens: int
    cached_tokens: int
    fingerprint: dict[str, str]


class EmbeddingsClient(Protocol):
    def embed(self, model: str, texts: list[str]) -> Embedded: ...


class HttpClient:
    """The OpenAI embeddings API over HTTP; vectors travel as base64 float32 (exact)."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 300.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def models(self) -> list[dict[str, Any]]:
        try:
            resp = self._http.get("/v1/models")
        except httpx.HTTPError as exc:
            raise VerifyUsageError(f"cannot reach {self.url}: {exc}") from None
        if resp.status_code != 200:
            raise VerifyUsageError(f"GET {self.url}/v1/models answered {resp.status_code}: "
                                   f"{resp.text[:300]}")
        return resp.json()["data"]

    def embed(self, model: str, texts: list[str]) -> Embedded:
        body = {"model": model, "input": texts, "encoding_format": "base64"}
        try:
            resp = self._http.post("/v1/embeddings", json=body)
        except httpx.HTTPError as exc:
            raise ServerError(f"POST /v1/embeddings failed: {exc}") from None
        if resp.status_code != 200:
            raise ServerError(f"POST /v1/embeddings ({len(texts)} text(s)) answered "
                              f"{resp.status_code}: {resp.text[:300]}")
        data = resp.json()
        items = sorted(data["data"], key=lambda d: d["index"])
        vectors = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
                            for d in items])
        usage = data.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return Embedded(vectors, int(usage.get("prompt_tokens") or 0), int(cached),
                        {k: resp.headers[k] for k in FINGERPRINT_KEYS if k in resp.headers})
