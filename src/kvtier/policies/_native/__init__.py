"""The built-in cache policies' compiled per-key steps (``_steps``, from
``_steps.c``), built at install where a C compiler is; ARC and S3-FIFO fall
back to Python without it. A package of its own, importing nothing."""
