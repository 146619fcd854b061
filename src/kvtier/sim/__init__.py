"""Trace replay: size the primary tier and choose its eviction policy offline.

``kvtier simulate`` replays a recorded trace (Mooncake's JSONL format, which
kvtier's own recorder also writes) through kvtier's real policy objects and
sets each against Belady's MIN.
"""

from kvtier.sim.replay import CellResult, belady_min, replay
from kvtier.sim.trace import Request, TraceFormatError, read_trace

__all__ = ["CellResult", "Request", "TraceFormatError", "belady_min", "read_trace", "replay"]
