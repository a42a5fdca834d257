"""``/tokenize`` on the replica (``replica/tokenize.py``): bounded by characters and tokens
before the per-token response is built, admitted by lane with a bounded queue, and run off the
event loop. The tokenizer is MiniLM's real one; nothing else is stood in for."""

from __future__ import annotations

import asyncio
import time

import pytest

from embedfleet.deployments.common.errors import Overloaded, RequestTooLarge
from embedfleet.deployments.replica.tokenize import TOKENIZE_MAX_WAITING, TokenizeQueue


def queue(**kw) -> TokenizeQueue:
    args = dict(model="m", max_inputs=2048, max_chars=1 << 20, max_tokens=1 << 20,
                queue_timeout_s=5.0)
    return TokenizeQueue(**{**args, **kw})


def test_the_answer_is_tei_s_token_list(minilm_tokenizer):
    texts = ["Hello world", "embedfleet tokenises off the loop"]
    got = asyncio.run(queue().tokenize(minilm_tokenizer, texts, True))
    assert [[t["id"] for t in toks] for toks in got] == minilm_tokenizer(texts)["input_ids"]
    assert got[0][1] == {"id": 7592, "text": "Hello", "special": False, "start": 0, "stop": 5}


def test_characters_past_the_bound_are_413_before_the_tokenizer_runs():
    class NeverCalled:
        def __call__(self, *a, **kw):
            raise AssertionError("tokenised a body past the character bound")

    with pytest.raises(RequestTooLarge) as err:
        asyncio.run(queue(max_chars=10).tokenize(NeverCalled(), ["a" * 11], True))
    assert err.value.status == 413 and "limits.max_chars of 10" in err.value.message


def test_tokens_past_the_bound_are_413_and_no_token_list_is_built(minilm_tokenizer):
    text = "word " * 100  # 100 word tokens + [CLS] and [SEP]
    assert asyncio.run(queue(max_tokens=102).tokenize(minilm_tokenizer, [text], True))
    with pytest.raises(RequestTooLarge) as err:
        asyncio.run(queue(max_tokens=101).tokenize(minilm_tokenizer, [text], True))
    assert "102 tokens" in err.value.message and "limits.max_tokens of 101" in err.value.message


def test_a_large_body_is_tokenised_while_the_event_loop_keeps_running(minilm_tokenizer):
    """The loop ticks while a ~400k-character body is tokenised: health checks and other calls
    are answered meanwhile (on the loop, the ticker could not run until it was done)."""
    texts = ["some words of a rather long document " * 11_000]

    async def scenario() -> tuple[int, int]:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.create_task(ticker())
        out = await queue().tokenize(minilm_tokenizer, texts, True)
        done.set()
        await t
        return ticks, len(out[0])

    ticks, n = asyncio.run(scenario())
    assert n > 60_000 and ticks > 10


class Slow:
    """MiniLM's tokenizer, ``seconds`` slower; ``during()`` runs while it works."""

    def __init__(self, tokenizer, seconds: float, during=lambda: None) -> None:
        self.tokenizer, self.seconds, self.during = tokenizer, seconds, during

    def __call__(self, texts, **kw):
        time.sleep(self.seconds)
        self.during()
        return self.tokenizer(texts, **kw)

    def convert_ids_to_tokens(self, ids):
        return self.tokenizer.convert_ids_to_tokens(ids)


def test_past_its_waiting_slots_a_tokenize_call_gets_429(minilm_tokenizer):
    """One call of the whole character budget holds it; the queue behind it is bounded."""
    q = queue(max_chars=100, queue_timeout_s=30)
    slow = Slow(minilm_tokenizer, 0.5)

    async def scenario():
        first = asyncio.create_task(q.tokenize(slow, ["a" * 100], True))
        await asyncio.sleep(0.05)
        waiting = [asyncio.create_task(q.tokenize(slow, ["b"], True))
                   for _ in range(TOKENIZE_MAX_WAITING)]
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded) as err:
            await q.tokenize(slow, ["c"], True)
        assert err.value.status == 429 and err.value.retry_after_s >= 1
        for t in [first, *waiting]:
            t.cancel()
        await asyncio.gather(first, *waiting, return_exceptions=True)

    asyncio.run(scenario())


def test_a_cancelled_call_holds_its_budget_until_its_thread_is_done(minilm_tokenizer):
    q = queue(max_chars=100)
    released = []
    slow = Slow(minilm_tokenizer, 0.3,
                lambda: released.append(q.budget.snapshot()["inflight_tokens"]))  # still held

    async def scenario():
        call = asyncio.create_task(q.tokenize(slow, ["a" * 100], True))
        await asyncio.sleep(0.05)
        call.cancel()
        await asyncio.sleep(0.05)
        held = q.budget.snapshot()["inflight_tokens"]
        with pytest.raises(asyncio.CancelledError):
            await call
        return held, q.budget.snapshot()["inflight_tokens"]

    held, after = asyncio.run(scenario())
    assert held == 100 and released == [100] and after == 0
