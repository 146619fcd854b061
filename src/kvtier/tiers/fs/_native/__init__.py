"""The fs tier's compiled chunk-file I/O (``_chunkio``, from ``_chunkio.c``),
built at install where a C compiler is; :mod:`kvtier.tiers.fs.io` falls back
to Python without it.

A package of its own, importing nothing, so that importing the extension does
not import :mod:`kvtier.tiers.fs` (whose ``__init__`` imports the tier, which
imports :mod:`~kvtier.tiers.fs.io`): no import circle.
"""
