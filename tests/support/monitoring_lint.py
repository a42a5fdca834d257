"""Checks on the generated monitoring artefacts, usable from tests and from ``embedfleet verify``.

Each function returns a list of problems (empty = fine) rather than raising, so a caller sees
all of them at once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from embedfleet.monitoring import thresholds

# A PromQL identifier not glued to a preceding word, number or `$` (so `1h:5m` in a subquery
# and Grafana's `$__rate_interval` are not names).
_IDENT = re.compile(r"(?<![\w.$:])[A-Za-z_:][A-Za-z0-9_:]*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')


def metric_names(expr: str) -> set[str]:
    """Metric and recording-rule names used in ``expr``.

    A heuristic fitted to embedfleet's naming: a name is an identifier that contains
    ``embedfleet``, starts with ``ray_`` or contains ``:`` (the ``level:metric:operation`` form).
    Label values (quoted) are ignored; function names, label names and keywords never match.
    """
    bare = _STRING.sub('""', expr)
    return {m for m in _IDENT.findall(bare)
            if "embedfleet" in m or m.startswith("ray_") or ":" in m}


def unknown_metrics(exprs: Iterable[str], known: Iterable[str]) -> dict[str, set[str]]:
    """{expr: names it uses that are not in ``known``} for every offending expression."""
    known = set(known)
    out = {}
    for expr in exprs:
        missing = metric_names(expr) - known
        if missing:
            out[expr] = missing
    return out


def lint_alert_rules(doc: dict) -> list[str]:
    """Every alert has a known severity and summary, description and runbook_url annotations."""
    problems = []
    severities = {thresholds.SEVERITY_CRITICAL, thresholds.SEVERITY_WARNING}
    names = set()
    for group in doc.get("groups", []):
        for rule in group.get("rules", []):
            name = rule.get("alert")
            if name is None:
                continue
            if name in names:
                problems.append(f"{name}: defined twice")
            names.add(name)
            if rule.get("labels", {}).get("severity") not in severities:
                problems.append(f"{name}: severity must be one of {sorted(severities)}")
            annotations = rule.get("annotations", {})
            for key in ("summary", "description", "runbook_url"):
                if not annotations.get(key):
                    problems.append(f"{name}: missing annotation {key!r}")
            if not str(annotations.get("runbook_url", "")).startswith(thresholds.RUNBOOK_BASE_URL):
                problems.append(f"{name}: runbook_url is not under {thresholds.RUNBOOK_BASE_URL}")
    return problems


def _all_panels(panels: list[dict]) -> list[dict]:
    out = []
    for panel in panels:
        out.append(panel)
        out.extend(_all_panels(panel.get("panels", [])))  # collapsed rows nest theirs
    return out


def _overlap(a: dict, b: dict) -> bool:
    return (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
            and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])


def lint_dashboard(dash: dict, datasource_uids: Iterable[str]) -> list[str]:
    """Unique panel ids, a datasource and a query on every panel (rows are layout only), every
    target with an expr and a unique refId, gridPos inside the 24-column grid, no overlaps.

    ``datasource_uids``: the uids a panel may name, besides variables defined in templating.
    """
    problems: list[str] = []
    variables = {f"${{{v['name']}}}" for v in dash.get("templating", {}).get("list", [])
                 if v.get("type") == "datasource"}
    allowed = set(datasource_uids) | variables
    seen_ids: set = set()
    boxes: list[tuple[str, dict]] = []
    for panel in _all_panels(dash.get("panels", [])):
        title = f"panel {panel.get('id')!r} ({panel.get('title', '?')})"
        if "id" not in panel or panel["id"] in seen_ids:
            problems.append(f"{title}: missing or duplicate id")
        seen_ids.add(panel.get("id"))
        pos = panel.get("gridPos", {})
        if not all(isinstance(pos.get(k), int) for k in ("x", "y", "w", "h")):
            problems.append(f"{title}: gridPos needs integer x, y, w, h")
            continue
        if pos["w"] <= 0 or pos["h"] <= 0 or pos["x"] < 0 or pos["x"] + pos["w"] > 24:
            problems.append(f"{title}: gridPos {pos} is outside the 24-column grid")
        for other_title, other in boxes:
            if _overlap(pos, other):
                problems.append(f"{title} overlaps {other_title}")
        boxes.append((title, pos))
        if panel.get("type") == "row":
            continue
        if (panel.get("datasource") or {}).get("uid") not in allowed:
            problems.append(f"{title}: datasource must be one of {sorted(allowed)}")
        targets = panel.get("targets") or []
        if not targets:
            problems.append(f"{title}: no query")
        refs = [tgt.get("refId") for tgt in targets]
        if len(set(refs)) != len(refs) or None in refs:
            problems.append(f"{title}: refIds must be set and unique")
        for target in targets:
            if not str(target.get("expr", "")).strip():
                problems.append(f"{title}: target {target.get('refId')} has no expr")
            if (target.get("datasource") or {}).get("uid") not in allowed:
                problems.append(f"{title}: target {target.get('refId')} has no known datasource")
    return problems


def dashboard_exprs(dash: dict) -> list[str]:
    """Every PromQL expression in the dashboard: panel targets and query variables."""
    exprs = [t["expr"] for p in _all_panels(dash.get("panels", [])) for t in p.get("targets", [])
             if "expr" in t]
    for var in dash.get("templating", {}).get("list", []):
        query = var.get("query")
        if var.get("type") == "query":
            exprs.append(query["query"] if isinstance(query, dict) else str(query))
    return exprs


def rule_exprs(doc: dict) -> list[str]:
    return [r["expr"] for g in doc.get("groups", []) for r in g.get("rules", [])]


def recorded_names(doc: dict) -> set[str]:
    return {r["record"] for g in doc.get("groups", []) for r in g.get("rules", []) if "record" in r}
