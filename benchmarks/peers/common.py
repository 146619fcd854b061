"""What every peer driver shares: the chunks, the round protocol, the checks.

A driver runs in its peer's own environment (see ``scripts/peer-envs.sh``)
and imports nothing from kvtier: only the standard library, numpy (for
``physical.py``) and its peer. ``bench_peers.py`` starts it once per system
and chunk size, then sends one JSON command per line on stdin and reads one
JSON answer per line on stdout (the peers' own logs go to stderr). A
command ``{"dir", "seed", "chunk", "count"}`` runs one round (``run_round``)
on a fresh directory (empty for redis) with ``count`` chunks of ``chunk``
bytes made from that seed, and answers
``{"store_s", "load_s", "verified", "cold"}``; a wrong or missing chunk, or
any other failure, answers ``{"error": ...}`` and ends the driver.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, Protocol

BENCHMARKS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCHMARKS))  # physical.py, for drivers run by path

from physical import drop_caches  # noqa: E402


def chunk_payloads(seed: int, count: int, size: int) -> list[bytes]:
    """``count`` chunks of ``size`` pseudo-random bytes, the same in every process."""
    return [random.Random(f"{seed}:{index}").randbytes(size) for index in range(count)]


def check_chunks(who: str, expected: Sequence[bytes], loaded: Sequence[Any]) -> int:
    """Count of chunks whose loaded bytes equal the stored ones; raises on any other."""
    wrong = [
        index
        for index, (want, got) in enumerate(zip(expected, loaded, strict=True))
        if got is None or memoryview(got).tobytes() != want
    ]
    if wrong:
        raise RuntimeError(
            f"{who}: {len(wrong)} of {len(expected)} chunks loaded wrong or missing"
            f" (first: chunk {wrong[0]})"
        )
    return len(expected)


class Driver(Protocol):
    """One peer's storage, over a fresh directory (or database) per round."""

    def prepare(self, directory: str, payloads: Sequence[bytes]) -> None:
        """Open the storage and copy the chunks into the peer's own buffers (not timed)."""

    def store(self) -> None:
        """Store every prepared chunk and wait until the peer says each is stored."""

    def load(self) -> Sequence[Any]:
        """Every chunk, loaded back in order into the peer's own buffers."""

    def clear(self) -> None:
        """Forget the round's chunks and close the storage."""


def arguments(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--system", required=True)
    parser.add_argument(
        "--threads", type=int, default=16, help="I/O threads, where the peer has such a knob."
    )
    parser.add_argument("--redis-url", default="", help="The redis server, for redis peers.")
    return parser.parse_args()


def run_round(
    driver: Driver, system: str, directory: str, payloads: Sequence[bytes]
) -> dict[str, Any]:
    """One round of ``system``: store every chunk, then load every chunk and check its bytes.

    On a directory the store is timed up to ``os.sync()`` (so a system that
    writes through the page cache pays for reaching the disk, as one that
    writes with O_DIRECT does), then the directory's files leave the page
    cache before the load, so that loads read the disk. Preparing the
    chunks in the system's own buffers and checking them are not timed.
    """
    driver.prepare(directory, payloads)
    try:
        started = time.perf_counter()
        driver.store()
        if directory:
            os.sync()
        store_s = time.perf_counter() - started
        cold = drop_caches(directory) if directory else "in memory"
        started = time.perf_counter()
        loaded = driver.load()
        load_s = time.perf_counter() - started
        verified = check_chunks(system, payloads, loaded)
    finally:
        driver.clear()
    return {"store_s": store_s, "load_s": load_s, "verified": verified, "cold": cold}


def serve(build: Callable[[argparse.Namespace], Driver], description: str) -> NoReturn:
    """Answer ``bench_peers.py``'s rounds, one JSON line each (see the module doc)."""
    args = arguments(description)
    answers = sys.stdout
    sys.stdout = sys.stderr  # the peers' prints must not mix with the answers

    def answer(message: dict[str, Any]) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    try:
        driver = build(args)
        answer({"ready": True})
        for line in sys.stdin:
            command = json.loads(line)
            payloads = chunk_payloads(command["seed"], command["count"], command["chunk"])
            answer(run_round(driver, args.system, command["dir"], payloads))
    except Exception as error:  # the orchestrator reports it; a driver serves one run
        traceback.print_exc()
        answer({"error": f"{type(error).__name__}: {error}"})
        os._exit(1)
    # Some peers leave threads that never end (LMCache's event loop, when its
    # redis connection stays open because closing it can hang): leave without them.
    os._exit(0)
