"""Monitoring as code: thresholds, PromQL, Prometheus rules and config, Grafana dashboard.

``thresholds`` holds every number (with why), ``queries`` every PromQL name other code runs (the
governor reads ``queries.CARD_MEMORY_RATIO``, the same recording rule the memory alert uses).
The YAML/JSON under ``prometheus/`` and ``grafana/`` is generated from them and golden-tested:
``python -m embedfleet.monitoring.generate`` rewrites it, ``--check`` fails when it is out of date.
"""
