"""Write (or check) every generated monitoring file: Prometheus rules and config, Grafana JSON
and provisioning.

    python -m embedfleet.monitoring.generate          # rewrite what changed
    python -m embedfleet.monitoring.generate --check  # exit 1 and list files that are out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

from .grafana import dashboard
from .prometheus import generate as prometheus


def outputs() -> dict[Path, str]:
    return {**prometheus.outputs(), **dashboard.outputs()}


def main(argv: list[str] | None = None) -> int:
    check = "--check" in (argv if argv is not None else sys.argv[1:])
    stale = prometheus.write_or_check(outputs(), check)
    for path in stale:
        print(f"{'out of date' if check else 'wrote'}: {path}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
