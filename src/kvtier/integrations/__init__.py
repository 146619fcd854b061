"""Adapters that plug kvtier into inference engines."""
