"""A hand-moved clock for ``AdmissionBudget`` tests, and a measured drain rate through the
budget's own admissions (no private state set): for tests only, never installed."""

from __future__ import annotations

from embedfleet.deployments.replica.admission import AdmissionBudget


class Clock:
    """Time stands still until a test moves ``t``."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def measure(b: AdmissionBudget, clock: Clock, tokens: int, seconds: float) -> None:
    """One bulk call of ``tokens`` that holds the card for ``seconds``, then a query (the drain
    cap holds while queries come)."""
    async with b.admit(1, tokens, lane="bulk"):
        clock.t += seconds
    async with b.admit(1, 1):
        pass
