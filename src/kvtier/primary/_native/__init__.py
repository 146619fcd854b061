"""The primary tier's compiled per-chunk loops (``_slots``, from ``_slots.c``),
built at install where a C compiler is; :mod:`kvtier.primary.loops` falls
back to Python without it. A package of its own, importing nothing."""
