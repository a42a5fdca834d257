"""Length-aware batching: engine batches hold inputs of similar length, results keep input order.

Why: a batch's cost follows its longest member (padding on the attention kernels of most backends,
and the slowest sequence gates the step), so mixing a 20-token query with a 3,000-token chunk wastes
most of the batch. Operators of the seed workload kept each batch within ~20% in length.

Two layers:

* ``length_buckets`` / ``restore_order`` - pure functions for one request's inputs: group
  indices so that each group's longest is at most ``ratio`` times its shortest, bounded by a token
  budget and a size, every index exactly once; then put per-group outputs back in input order.
* ``LengthAwareBatcher`` - merges the pieces of *concurrent* callers (requests, and the chunks of
  one long input) in the replica, in front of the engine. It has a single owner task fed by
  callers (TEI's queue design): each caller appends its pieces with one future per piece; the
  owner waits up to ``collect_ms`` after the oldest pending piece arrived (or until a full batch
  is pending), buckets everything pending by length and hands groups to ``embed_fn``. A caller
  gets its vectors in its own order because each piece resolves its own future - the engine's
  order never leaks out.

  With ``max_inflight_batches`` set, the owner dispatches one group per free slot and prefers the
  fullest group (best engine use), which alone would starve a lone long input behind a stream of
  short ones; so a group whose oldest piece has waited ``max_wait_ms`` goes first. Without a bound
  every pending group is dispatched each round (vLLM's own scheduler then takes them in submission
  order, which is length order within a round).

  Pieces whose caller went away (cancelled) are dropped before they cost compute, and counted
  (``dropped_cancelled``); a failing batch fails only the futures of its own pieces.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

logger = logging.getLogger("embedfleet.batching")

T = TypeVar("T")
EmbedFn = Callable[[list[list[int]]], Awaitable[Sequence[T]]]

DEFAULT_RATIO = 1.2


def length_buckets(lengths: Sequence[int], ratio: float = DEFAULT_RATIO,
                   max_batch_tokens: int | None = None,
                   max_batch_size: int | None = None) -> list[list[int]]:
    """Group input indices by length: in each group ``max <= ratio * min``.

    Groups are built greedily from the shortest input up, so they come out in ascending length;
    within a group indices are in ascending length (ties in input order). A group also stays within
    ``max_batch_tokens`` (sum of lengths; an input longer than the budget is a group of its own) and
    ``max_batch_size`` inputs. Every index appears exactly once.
    """
    if ratio < 1:
        raise ValueError(f"ratio must be >= 1; got {ratio}")
    if max_batch_size is not None and max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1; got {max_batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups: list[list[int]] = []
    group: list[int] = []
    first = tokens = 0
    for i in order:
        n = lengths[i]
        fits = (group and n <= first * ratio
                and (max_batch_tokens is None or tokens + n <= max_batch_tokens)
                and (max_batch_size is None or len(group) < max_batch_size))
        if not fits:
            if group:
                groups.append(group)
            group, first, tokens = [], n, 0
        group.append(i)
        tokens += n
    if group:
        groups.append(group)
    return groups


def restore_order(groups: Sequence[Sequence[int]], outputs: Sequence[Sequence[T]]) -> list[T]:
    """Per-group outputs (aligned with ``groups``) back into input order.

    Checks that the groups cover ``0..n-1`` exactly once and that every group got one output per
    member, so a batching bug fails loudly instead of returning vectors for the wrong inputs.
    """
    if len(groups) != len(outputs):
        raise ValueError(f"{len(groups)} groups but {len(outputs)} output lists")
    n = sum(len(g) for g in groups)
    result: list[Any] = [None] * n
    seen = [False] * n
    for g, out in zip(groups, outputs):
        if len(g) != len(out):
            raise ValueError(f"group of {len(g)} inputs got {len(out)} outputs")
        for idx, value in zip(g, out):
            if not 0 <= idx < n or seen[idx]:
                raise ValueError(f"index {idx} is out of range or appears twice in {list(groups)}")
            seen[idx] = True
            result[idx] = value
    return result


@dataclass(eq=False)
class _Piece:
    tokens: list[int]
    future: asyncio.Future
    arrived: float


@dataclass(eq=False)
class LengthAwareBatcher(Generic[T]):
    """Merges concurrent callers' token sequences into length-homogeneous engine batches.

    Create it inside the replica (any time; the owner task starts on the first ``embed`` in the
    running loop) and call ``embed(pieces)`` from every request.
    """

    embed_fn: EmbedFn
    """``async (list of token-id lists) -> one output per list, same order``."""
    ratio: float = DEFAULT_RATIO
    max_batch_tokens: int | None = 16384
    """Token budget of one engine call (sum of lengths)."""
    max_batch_size: int | None = 256
    collect_ms: float = 2.0
    """How long the owner waits for concurrent callers after the oldest pending piece arrived."""
    max_wait_ms: float = 50.0
    """Starvation bound: a piece that has waited this long is in the next group dispatched."""
    max_inflight_batches: int | None = None
    """Engine calls in flight at once; None = dispatch every pending group each round."""

    dropped_cancelled: int = field(default=0, init=False)
    """Pieces dropped before dispatch because their caller went away."""
    batches_dispatched: int = field(default=0, init=False)
    _pending: list[_Piece] = field(default_factory=list, init=False, repr=False)
    _wakeup: asyncio.Event | None = field(default=None, init=False, repr=False)
    _slots: asyncio.Semaphore | None = field(default=None, init=False, repr=False)
    _owner: asyncio.Task | None = field(default=None, init=False, repr=False)
    _inflight: set[asyncio.Task] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.ratio < 1:
            raise ValueError(f"ratio must be >= 1; got {self.ratio}")
        if self.max_wait_ms < self.collect_ms:
            raise ValueError(f"max_wait_ms ({self.max_wait_ms}) must be >= collect_ms "
                             f"({self.collect_ms})")
        if self.max_inflight_batches is not None and self.max_inflight_batches < 1:
            raise ValueError(f"max_inflight_batches must be >= 1; got {self.max_inflight_batches}")

    # -- callers -------------------------------------------------------------------------------
    async def embed(self, pieces: Sequence[Sequence[int]]) -> list[T]:
        """One output per piece, in the order given; batched with concurrent callers."""
        if not pieces:
            return []
        self._start()
        loop = asyncio.get_running_loop()
        now = loop.time()
        futures = [loop.create_future() for _ in pieces]
        self._pending.extend(_Piece(list(p), f, now) for p, f in zip(pieces, futures))
        assert self._wakeup is not None
        self._wakeup.set()
        try:
            return list(await asyncio.gather(*futures))
        except BaseException:
            # Cancelled, or one piece failed: the rest of this caller's pieces are not wanted.
            for f in futures:
                if not f.done():
                    f.cancel()
                elif not f.cancelled():
                    f.exception()  # mark retrieved: one error is raised, siblings stay quiet
            raise

    async def close(self) -> None:
        """Stop the owner; pending and in-flight callers are cancelled."""
        tasks = [t for t in [self._owner, *self._inflight] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for p in self._pending:
            p.future.cancel()
        self._pending.clear()
        self._owner = None

    # -- the owner -----------------------------------------------------------------------------
    def _start(self) -> None:
        if self._owner is not None and not self._owner.done():
            return
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        if self._slots is None and self.max_inflight_batches is not None:
            self._slots = asyncio.Semaphore(self.max_inflight_batches)
        self._owner = asyncio.get_running_loop().create_task(self._run(), name="length-batcher")

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as exc:
            # A bug here must not leave callers waiting forever: fail them, restart on next call.
            logger.error("length batcher owner failed: %r", exc, exc_info=exc)
            for p in self._pending:
                if not p.future.done():
                    p.future.set_exception(exc)
            self._pending.clear()  # the next embed() starts a fresh owner (``_start``)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        while True:
            self._drop_cancelled()
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._collect(loop)
            if self._slots is not None:
                await self._slots.acquire()
            self._drop_cancelled()
            if not self._pending:
                if self._slots is not None:
                    self._slots.release()
                continue
            for group in self._choose(loop.time()):  # one group when slots are bounded
                self._dispatch(group)

    async def _collect(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait for concurrent callers: until collect_ms after the oldest piece, or a full batch."""
        assert self._wakeup is not None
        deadline = min(p.arrived for p in self._pending) + self.collect_ms / 1000
        while not self._full():
            left = deadline - loop.time()
            if left <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), left)
            except asyncio.TimeoutError:
                return

    def _full(self) -> bool:
        return ((self.max_batch_size is not None and len(self._pending) >= self.max_batch_size)
                or (self.max_batch_tokens is not None
                    and sum(len(p.tokens) for p in self._pending) >= self.max_batch_tokens))

    def _drop_cancelled(self) -> None:
        keep = [p for p in self._pending if not p.future.done()]
        self.dropped_cancelled += len(self._pending) - len(keep)
        self._pending = keep

    def _choose(self, now: float) -> list[list[_Piece]]:
        pending = self._pending
        idx_groups = length_buckets([len(p.tokens) for p in pending], self.ratio,
                                    self.max_batch_tokens, self.max_batch_size)
        groups = [[pending[i] for i in g] for g in idx_groups]
        oldest = [min(p.arrived for p in g) for g in groups]
        if self._slots is None:
            # Everything goes this round; oldest-first submission keeps the engine's FCFS fair.
            return [g for _, g in sorted(zip(oldest, groups), key=lambda x: x[0])]
        first = min(range(len(groups)), key=lambda k: oldest[k])
        if now - oldest[first] >= self.max_wait_ms / 1000:
            return [groups[first]]  # starvation guard
        return [max(groups, key=len)]

    def _dispatch(self, group: list[_Piece]) -> None:
        chosen = {id(p) for p in group}
        self._pending = [p for p in self._pending if id(p) not in chosen]
        self.batches_dispatched += 1
        task = asyncio.get_running_loop().create_task(self._run_batch(group))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _run_batch(self, group: list[_Piece]) -> None:
        try:
            out = await self.embed_fn([p.tokens for p in group])
            if len(out) != len(group):
                raise RuntimeError(f"embed_fn returned {len(out)} outputs for {len(group)} inputs")
        except asyncio.CancelledError:
            for p in group:
                p.future.cancel()
            raise
        except Exception as exc:  # fail this batch's callers only; the owner keeps going
            for p in group:
                if not p.future.done():
                    p.future.set_exception(exc)
        else:
            for p, value in zip(group, out):
                if not p.future.done():  # its caller may have gone away meanwhile
                    p.future.set_result(value)
        finally:
            if self._slots is not None:
                self._slots.release()
