"""Prometheus side: rules as data (``rules``), the scrape config (``config``), and the generator."""
