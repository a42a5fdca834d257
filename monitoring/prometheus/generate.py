"""Write (or check) the generated Prometheus files: rule files and the default prometheus.yml.

    python -m embedfleet.monitoring.prometheus.generate          # rewrite
    python -m embedfleet.monitoring.prometheus.generate --check  # exit 1 if a checked-in file differs
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from . import rules
from .config import HEADER, RULE_FILES, RULES_DIR, render_prometheus_config

HERE = Path(__file__).resolve().parent


class _Dumper(yaml.SafeDumper):
    """Multi-line PromQL as literal blocks, so the YAML reads like the expression."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(data: dict) -> str:
    return HEADER + yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=100,
                              allow_unicode=True)


def outputs() -> dict[Path, str]:
    """Every generated file and its content."""
    recording, alerts = RULE_FILES
    return {
        RULES_DIR / recording: dump(rules.recording_groups()),
        RULES_DIR / alerts: dump(rules.alert_groups()),
        # The checked-in config works as-is from this directory:
        # `prometheus --config.file=monitoring/prometheus/prometheus.yml`.
        HERE / "prometheus.yml": render_prometheus_config(rules_dir="rules"),
    }


def write_or_check(files: dict[Path, str], check: bool) -> list[Path]:
    """Write ``files``; with ``check``, write nothing and return the ones that differ."""
    stale = [p for p, text in files.items()
             if not p.exists() or p.read_text(encoding="utf-8") != text]
    if not check:
        for path in stale:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(files[path], encoding="utf-8")
    return stale


def main(argv: list[str] | None = None) -> int:
    check = "--check" in (argv if argv is not None else sys.argv[1:])
    stale = write_or_check(outputs(), check)
    for path in stale:
        print(f"{'out of date' if check else 'wrote'}: {path}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
