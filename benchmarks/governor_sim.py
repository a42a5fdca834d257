"""SIMULATION — the memory governor against a surge of 32K-token requests on one simulated card.

    python -m benchmarks.governor_sim [--requests 400] [--seed 0]

Nothing here touches a real card or engine. A simulated 910B card (64 GB HBM) holds the weights
and KV cache the engine planned for (~40 GB), and each token in flight needs activation memory the
engine did NOT plan for (long inputs in a big batch — what gave the seed operators 17 OOMs in 72 h).
The card's memory is sampled into a simulated Prometheus every scrape interval; the governor runs
embedfleet's real control law (``cluster.governor_law.step``) on those samples every interval and
sets the card's admission budget; admission is FIFO with the lone-oversize rule like
``deployments.budget``. If memory passes capacity the card "OOMs": every request in flight fails
and the card is down for a restart. The report compares governor on (the law) and off (budget
fixed at the engine's ceiling): simulated OOMs, completed requests, tokens/s.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import deque
from dataclasses import dataclass

from cluster.governor_law import CardLimits, CardState, GovernorParams, step

GB = 1 << 30


@dataclass
class Card:
    capacity: float = 64 * GB
    planned: float = 40 * GB           # weights + KV cache the engine reserved at start
    per_token: float = 0.12 * (1 << 20)  # unplanned activation bytes per token in flight
    tokens_per_s: float = 9000.0       # prefill throughput shared by the requests in flight
    restart_s: float = 45.0


def simulate(governor: bool, n_requests: int, seed: int, dt: float = 0.1) -> dict:
    rng = random.Random(seed)
    card = Card()
    ceiling = CardLimits(max_sequences=64, max_tokens=262_144)
    params = GovernorParams(cooldown_s=15)
    state = CardState.initial(ceiling)
    # a surge: 32K-token requests (some shorter) arriving at ~1.2 per second
    t_arrive, arrivals = 0.0, []
    for _ in range(n_requests):
        t_arrive += rng.expovariate(1.2)
        arrivals.append((t_arrive, rng.choice([32768, 32768, 32768, 16384, 8192])))
    queue: deque = deque()
    inflight: list[list[float]] = []  # [remaining tokens, size]
    now, down_until, ooms, done_tokens, done, failed = 0.0, -1.0, 0, 0, 0, 0
    samples: list[tuple[float, float]] = []  # (ts, ratio): the simulated Prometheus
    next_scrape, next_tick, i = 0.0, 0.0, 0
    while (i < len(arrivals) or queue or inflight) and now < 3600:
        while i < len(arrivals) and arrivals[i][0] <= now:
            queue.append(arrivals[i][1])
            i += 1
        used = card.planned + card.per_token * sum(r[1] for r in inflight)
        if now >= next_scrape:
            samples.append((now, used / card.capacity))
            next_scrape += 5.0
        if governor and now >= next_tick:
            ts, ratio = samples[-1] if samples else (None, None)
            state = step(params, ceiling, state, ratio, ts, now)
            next_tick += 5.0
        limits = state.limits if governor else ceiling
        if now >= down_until:
            # FIFO admission; an oversize request runs alone
            while queue:
                size = queue[0]
                toks = sum(r[1] for r in inflight)
                fits = (len(inflight) < limits.max_sequences
                        and toks + size <= limits.max_tokens)
                if fits or (not inflight and size > limits.max_tokens):
                    inflight.append([size, size])
                    queue.popleft()
                else:
                    break
            if inflight:
                share = card.tokens_per_s * dt / len(inflight)
                for r in inflight:
                    r[0] -= share
                for r in [r for r in inflight if r[0] <= 0]:
                    inflight.remove(r)
                    done += 1
                    done_tokens += r[1]
            used = card.planned + card.per_token * sum(r[1] for r in inflight)
            if used > card.capacity:
                ooms += 1
                failed += len(inflight)
                queue.extendleft(r[1] for r in reversed(inflight))  # clients retry
                inflight.clear()
                down_until = now + card.restart_s
        now += dt
    return {"governor": "on" if governor else "off", "simulated_ooms": ooms,
            "requests_completed": done, "requests_failed_by_oom": failed,
            "seconds": round(now, 1), "tokens_per_s": round(done_tokens / now, 1),
            "final_budget_tokens": state.limits.max_tokens if governor else ceiling.max_tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    report = {"simulation": "one simulated 64 GB card; not hardware measurements",
              "runs": [simulate(False, args.requests, args.seed),
                       simulate(True, args.requests, args.seed)]}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
