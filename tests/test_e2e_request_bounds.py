"""One request's work is bounded and never stalls the card for others (issue 38), end to end.

* A ~2 MB ``long_input: chunk`` text is refused with 413 within 2 s, from the body, before it is
  tokenised; while it and a large request within the bounds run, a one-text request sent every
  0.5 s to the same one-replica model (MiniLM: minilm-zero, started afresh) is always
  answered 200, with max <= 2 s (on a loaded machine: the slowest quiet probe plus eight of the
  large request's chunk times) and p50 <= 0.5 s. Before, the large request ran as one oversize
  call alone on the card, and every probe waited for all of it.
* What the runs promise holds at any machine speed: a probe waits for at most about the one run
  in the engine when it comes (one 256-token chunk here), so its median exceeds the same probes'
  median on the quiet card (taken right after) by less than one chunk's time (the large
  request's time per chunk). One-chunk runs add 0.4-0.6 of it; a request sent whole adds
  seconds. Runs of four chunks added 0.9-1.6 of it, so that smaller regression is caught only
  some of the time. The absolute p50 is this machine's floor: on a machine so loaded that the
  quiet probes' median is past ``QUIET_PROBE_P50_S``, that check says inconclusive (the test is
  skipped with both medians) after every other check passed.
* ``/tokenize`` has the same bounds: 20,000 inputs, a body past the character bound and one past
  the token bound get a 4xx within 2 s, and the replica that tokenised is not restarted.
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest
import requests

from tests.texts import doc
from tests.conftest import MINILM, ZERO
from tests.support.live_cluster import model_status, wait_for

pytestmark = pytest.mark.cluster

# A quiet probe's median on this machine is ~0.03 s (ingress, replica, one engine step); past
# three times that, the machine is too loaded for its absolute floor to say anything.
QUIET_PROBE_P50_S = 0.1
# A probe's worst wait, in the large request's chunk times, past the slowest quiet probe: one run
# in the engine when it comes, one just queued, and the machine's jitter.
MAX_WAIT_CHUNKS = 8


class Prober:
    """A one-text request to ``model`` every 0.5 s, each on its own thread (a slow answer does
    not delay the next probe): (seconds, status) per probe."""

    def __init__(self, cluster: str, model: str) -> None:
        self.cluster, self.model = cluster, model
        self.results: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _one(self, k: int) -> None:
        t0 = time.monotonic()
        try:
            r = requests.post(f"{self.cluster}/v1/embeddings", timeout=60,
                              json={"model": self.model, "input": f"probe number {k}"})
            status = r.status_code
        except requests.RequestException:
            status = -1
        with self._lock:
            self.results.append((time.monotonic() - t0, status))

    def _loop(self) -> None:
        k = 0
        while not self._stop.wait(0 if k == 0 else 0.5):
            t = threading.Thread(target=self._one, args=(k,), daemon=True)
            t.start()
            self._threads.append(t)
            k += 1

    def __enter__(self) -> Prober:
        self._main = threading.Thread(target=self._loop, daemon=True)
        self._main.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._main.join()
        for t in self._threads:
            t.join(timeout=70)


def card_replicas(cluster: str, model: str) -> set[str]:
    data = requests.get(f"{cluster}/v1/models", timeout=30).json()["data"]
    return {c["replica_id"] for m in data if m["id"] == model for c in m["replicas"]["cards"]}


def test_a_giant_request_is_refused_at_once_and_a_large_one_never_stalls_the_card(cluster):
    # minilm-zero: MiniLM on one replica (engine steps of 8,192 tokens: limits of 32,768 tokens
    # and 262,144 characters). Start it afresh (cold_start_hold_s 400), and send the large request
    # at once: Serve's autoscaler sees only samples of a replica's requests in flight, every
    # 2.4 s and pushed every 10 s, which rarely catch a 30 ms probe; a replica already idle for
    # a while when the test starts was scaled to zero mid-test (downscale_delay_s 8 s here).
    wait_for(lambda: model_status(cluster, ZERO)["state"] == "scaled to zero", 180,
             f"{ZERO} scaled to zero", every=2)
    warm = requests.post(f"{cluster}/v1/embeddings", timeout=600,
                         json={"model": ZERO, "input": "warm up"})
    assert warm.status_code == 200, warm.text[:300]
    giant = "evidence " * 230_000  # ~2 MB of text
    large = doc(22_000, seed=38)   # ~23k tokens, ~29k in chunk windows: within the bounds
    with Prober(cluster, ZERO) as probes:
        time.sleep(1.5)  # queries are coming when the large request starts
        t0 = time.monotonic()
        r = requests.post(f"{cluster}/v1/embeddings", timeout=60, json={
            "model": ZERO, "input": giant, "long_input": "chunk"})
        refused_s = time.monotonic() - t0
        assert r.status_code == 413, r.text[:500]
        err = r.json()["error"]
        assert "limits.max_chars" in err["message"] and str(len(giant)) in err["message"]
        assert refused_s <= 2.0, refused_s

        t0 = time.monotonic()
        r = requests.post(f"{cluster}/v1/embeddings", timeout=300, json={
            "model": ZERO, "input": large, "long_input": "chunk"})
        large_s = time.monotonic() - t0
        assert r.status_code == 200, r.text[:500]
        chunks = r.json()["embedfleet"]["inputs"][0]["chunks"]
        assert chunks > 100
        time.sleep(1.0)
    # The same probes on the quiet card, the baseline: right after the large request, whose
    # time in flight keeps Serve from scaling the model to zero meanwhile (see above).
    with Prober(cluster, ZERO) as quiet:
        time.sleep(4.0)
    quiet_p50 = statistics.median(t for t, _ in quiet.results)
    assert all(s == 200 for _, s in quiet.results), quiet.results
    assert large_s > 5, f"the large request took {large_s:.1f}s: too small to test anything"
    statuses = [s for _, s in probes.results]
    assert len(statuses) >= 10 and all(s == 200 for s in statuses), statuses
    latencies = sorted(t for t, _ in probes.results)
    p50, chunk_s = statistics.median(latencies), large_s / chunks
    # No probe waits for the large request: sent whole, one waited nearly all of it (> 5 s).
    # 2 s on a quiet machine; a loaded one stretches every wait, and the large request's time per
    # chunk with it, so the bound is at least the slowest quiet probe plus eight chunks' time.
    worst = max(2.0, max(t for t, _ in quiet.results) + MAX_WAIT_CHUNKS * chunk_s)
    assert latencies[-1] <= worst, (worst, latencies[-5:])
    assert latencies[-1] < large_s / 2, (large_s, latencies[-5:])
    print(f"probes: p50 {p50:.3f}s (quiet {quiet_p50:.3f}s), max {latencies[-1]:.3f}s, "
          f"n={len(latencies)}; large request {large_s:.1f}s, {chunks} chunks")
    assert p50 - quiet_p50 <= chunk_s, (
        f"a probe waited {p50 - quiet_p50:.3f}s more than on the quiet card, more than one "
        f"chunk's time ({chunk_s:.3f}s): the large request's runs hold more than a chunk")
    if quiet_p50 > QUIET_PROBE_P50_S:
        pytest.skip(f"inconclusive for the absolute p50: the machine is loaded (a quiet probe's "
                    f"p50 {quiet_p50:.3f}s > {QUIET_PROBE_P50_S}s; during the large request "
                    f"{p50:.3f}s)")
    assert p50 <= 0.5, latencies


def test_tokenize_is_bounded_and_its_replica_survives(cluster):
    before = card_replicas(cluster, MINILM)
    cases = {
        "20,000 inputs": ({"inputs": ["a"] * 20_000, "model": MINILM}, (413, 422)),
        "8 MiB body": ({"inputs": ["evidence " * 932_000], "model": MINILM}, (413,)),
        "characters": ({"inputs": ["evidence " * 350_000], "model": MINILM}, (413,)),
        # 200k characters (inside the bound), 100k tokens (past limits.max_tokens)
        "tokens": ({"inputs": ["a " * 100_000], "model": MINILM}, (413,)),
    }
    for what, (body, statuses) in cases.items():
        t0 = time.monotonic()
        r = requests.post(f"{cluster}/tokenize", json=body, timeout=60)
        took = time.monotonic() - t0
        assert r.status_code in statuses, (what, r.status_code, r.text[:300])
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, what
        assert took <= 2.0, (what, took)
    fine = requests.post(f"{cluster}/tokenize", timeout=60,
                         json={"inputs": [doc(2_000, seed=8)], "model": MINILM})
    assert fine.status_code == 200 and len(fine.json()[0]) > 2_000
    assert requests.get(f"{cluster}/health", timeout=10).status_code == 200
    assert card_replicas(cluster, MINILM) == before  # no replica was restarted
