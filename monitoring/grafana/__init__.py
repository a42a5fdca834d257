"""Grafana side: the dashboard as code (``dashboard``) and its provisioning."""
