"""kvtier's log records in vLLM's own log output."""

from __future__ import annotations

import logging


def follow_vllm_logging() -> None:
    """Send kvtier's records through vLLM's handlers, at vLLM's level.

    vLLM configures only its own ``vllm`` logger (which does not propagate),
    so kvtier's INFO lines, such as which tiers started, would otherwise never
    reach a ``vllm serve`` log. Left alone where the operator gave ``kvtier``
    handlers of its own, or where vLLM configures no logging
    (``VLLM_CONFIGURE_LOGGING=0``).
    """
    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False  # vLLM's handlers print it once
