"""``/tokenize`` on the replica: bounded, admitted by lane, and off the event loop.

A tokenize call costs the replica's CPU, not the card: the model's tokenizer, then one dict per
token for TEI's response. Run on the replica's event loop, an 8 MiB body blocked it for tens of
seconds, past Serve's health-check timeout, and Serve killed the replica with every call on it.
So the route gets what ``/embed`` has:

* **limits** — the request's inputs and characters are checked at the ingress
  (``pipeline.check_request_size``) and again here (a replica is a process boundary), its tokens
  once encoded, before one dict per token is built: the response is at most
  ``limits.max_tokens`` tokens;
* **admission** — an ``AdmissionBudget`` of its own (inputs and characters in flight, the
  tokenizer's work), FIFO per lane with interactive first, a bounded queue and a bounded wait:
  429 + Retry-After past them. Not the card's budget: tokenizing holds no engine memory, and its
  time would read as a slow card in the drain rate that sizes bulk's runs;
* **off the loop** — in a worker thread (the fast tokenizers release the GIL while encoding), so
  health checks and embedding calls keep being answered meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from ..common.contracts import Lane, SimpleToken
from ..common.errors import RequestTooLarge
from .admission import AdmissionBudget

# Calls that may wait for the tokenizer at once: a caller past them gets 429 at once.
TOKENIZE_MAX_WAITING = 64


def simple_tokens(text: str, ids: Sequence[int], offsets: Sequence[tuple[int, int]],
                  special_mask: Sequence[int], tokens: Sequence[str]) -> list[SimpleToken]:
    """TEI's ``SimpleToken`` list for one input, from a tokenizer's encoding of ``text``.

    ``offsets`` are character offsets (what HF fast tokenizers return); ``text`` must be the string
    that was tokenised (after any prompt template), so the slices line up.
    """
    if not len(ids) == len(offsets) == len(special_mask) == len(tokens):
        raise ValueError(f"encoding fields disagree in length: {len(ids)} ids, {len(offsets)} "
                         f"offsets, {len(special_mask)} mask entries, {len(tokens)} tokens")
    out: list[SimpleToken] = []
    for tid, (start, stop), special, tok in zip(ids, offsets, special_mask, tokens):
        if special:
            out.append({"id": int(tid), "text": tok, "special": True, "start": None, "stop": None})
        else:
            out.append({"id": int(tid), "text": text[start:stop], "special": False,
                        "start": int(start), "stop": int(stop)})
    return out


class TokenizeQueue:
    def __init__(self, *, model: str, max_inputs: int, max_chars: int, max_tokens: int,
                 queue_timeout_s: float, on_reject: Callable[[str], None] | None = None) -> None:
        self.model = model
        self.max_chars = max_chars
        self.max_tokens = max_tokens
        self.budget = AdmissionBudget(max_inputs, max_chars, max_waiting=TOKENIZE_MAX_WAITING,
                                      queue_timeout_s=queue_timeout_s, bulk_max_drain_s=None,
                                      on_reject=on_reject)

    async def tokenize(self, tokenizer: Any, texts: Sequence[str], add_special_tokens: bool,
                       lane: Lane = "interactive") -> list[list[SimpleToken]]:
        chars = sum(len(t) for t in texts)
        if chars > self.max_chars:
            raise RequestTooLarge(
                f"inputs has {chars} characters in all, more than model '{self.model}''s "
                f"limits.max_chars of {self.max_chars}", param="inputs")
        async with self.budget.admit(max(1, len(texts)), chars, lane=lane):
            work = asyncio.ensure_future(asyncio.to_thread(self._tokenize, tokenizer, list(texts),
                                                           add_special_tokens))
            try:
                return await asyncio.shield(work)
            except asyncio.CancelledError:
                # A thread cannot be stopped: the budget stays held until it is done, or a
                # client that hangs up would leave the tokenizer busy beyond its budget.
                await asyncio.wait({work})
                raise

    def _tokenize(self, tokenizer: Any, texts: list[str],
                  add_special_tokens: bool) -> list[list[SimpleToken]]:
        enc = tokenizer(texts, add_special_tokens=add_special_tokens,
                        return_offsets_mapping=True, return_special_tokens_mask=True)
        tokens = sum(len(ids) for ids in enc["input_ids"])
        if tokens > self.max_tokens:
            raise RequestTooLarge(
                f"inputs make {tokens} tokens, more than model '{self.model}''s "
                f"limits.max_tokens of {self.max_tokens}; split it over several requests",
                param="inputs")
        return [simple_tokens(text, ids, offs, mask, tokenizer.convert_ids_to_tokens(ids))
                for text, ids, offs, mask in zip(texts, enc["input_ids"], enc["offset_mapping"],
                                                  enc["special_tokens_mask"])]
