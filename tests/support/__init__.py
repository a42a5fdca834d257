"""Test-time helpers: models and fixtures that are built, not downloaded."""
