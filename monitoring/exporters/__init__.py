"""Exporters that ship with embedfleet. Only stand-ins for tests and demos live here so far."""
