"""Eviction policies measured against leaf-lru and not shipped, kept so the
figures in docs/policies-and-specs.md can be rerun (``python
benchmarks/policy_lab/run.py``). Each is a ``CachePolicy``; none is registered
in kvtier."""
