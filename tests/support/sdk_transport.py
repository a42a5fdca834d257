"""An httpx client whose requests go through starlette's TestClient to the router's app in
process, so an SDK built on httpx (Cohere's) talks to the real routes without a server: the
SDK's own request is replayed on the test client and its answer handed back unchanged."""

from __future__ import annotations

import httpx
from starlette.testclient import TestClient


def in_process_httpx(client: TestClient) -> httpx.Client:
    def forward(request: httpx.Request) -> httpx.Response:
        r = client.request(request.method, request.url.path, content=request.read(),
                           headers=dict(request.headers))
        return httpx.Response(r.status_code, headers=dict(r.headers), content=r.content)

    return httpx.Client(transport=httpx.MockTransport(forward))
