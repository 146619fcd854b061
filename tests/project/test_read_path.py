"""``scripts/paths/redis_get.txt`` names every kvtier function one default Redis
GET runs: a real GET against redis-server is traced, and each function it
enters must lie inside a function or class the path file names. A count by
``scripts/read_path.py`` then cannot leave out code the GET runs.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from kvtier.testing import TierHarness, small_layout
from kvtier.tiers.base import Lookup, LookupContext, TransferJob
from kvtier.tiers.redis import RedisTier
from tests.support.servers import RedisServer

ROOT = Path(__file__).resolve().parents[2]
PATH_FILE = ROOT / "scripts" / "paths" / "redis_get.txt"


def _read_path_module() -> Any:
    spec = importlib.util.spec_from_file_location("read_path", ROOT / "scripts" / "read_path.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _named_lines() -> dict[str, set[int]]:
    """Per source file, the lines the path file's names cover."""
    read_path = _read_path_module()
    covered: dict[str, set[int]] = {}
    for line in PATH_FILE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        module, qualname = line.split()
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None, module
        first, last = read_path.spans(Path(spec.origin))[qualname]
        covered.setdefault(str(Path(spec.origin).resolve()), set()).update(range(first, last + 1))
    return covered


class _Tracer:
    """Every kvtier function entered, on any thread, while :attr:`on`."""

    def __init__(self) -> None:
        self.on = False
        self.entered: set[tuple[str, int, str]] = set()

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if self.on and event == "call":
            module = frame.f_globals.get("__name__", "")
            if module.startswith("kvtier.") and not module.startswith("kvtier.testing"):
                code = frame.f_code
                self.entered.add((code.co_filename, code.co_firstlineno, code.co_qualname))

    @classmethod
    def installed(cls) -> Iterator[_Tracer]:
        tracer = cls()
        # Before the tier starts its threads, so that its workers and its
        # deadline thread trace too.
        threading.settrace(tracer)
        sys.settrace(tracer)
        try:
            yield tracer
        finally:
            sys.settrace(None)
            threading.settrace(None)


@pytest.fixture
def tracer() -> Iterator[_Tracer]:
    yield from _Tracer.installed()


def test_the_path_file_names_every_function_a_default_get_runs(
    tracer: _Tracer, redis_server: RedisServer, key_prefix: str
) -> None:
    harness = TierHarness(
        {"type": "redis", "url": redis_server.url, "key_prefix": key_prefix},
        small_layout(),
        tier_class=RedisTier,
    )
    try:
        tier = harness.tier
        keys = harness.keys(2)
        harness.fill([0, 1])
        assert harness.store(keys, [0, 1]).success
        # A first load allocates the worker's buffers once: not part of a GET.
        assert harness.load(keys[:1], [2]).success
        job = TransferJob(keys=(keys[1],), slots=(3,), request_id="r")
        context = LookupContext(request_id="r")
        tracer.on = True
        answer = tier.lookup(keys[1], context)
        tier.on_step_end()
        while answer is Lookup.PENDING:
            time.sleep(0.002)
            answer = tier.lookup(keys[1], context)
        assert answer is Lookup.HIT
        tier.submit_load(job)
        results = tier.get_finished_jobs()
        while not results:
            time.sleep(0.002)
            results = tier.get_finished_jobs()
        # The deadlines of the check and of the load fire (and find them done).
        time.sleep(tier.options.deadline_s + 0.3)
        tracer.on = False
        assert results[0].success
    finally:
        harness.close()
    covered = _named_lines()
    missed = sorted(
        f"{Path(filename).name}:{line} {qualname}"
        for filename, line, qualname in tracer.entered
        if Path(filename).exists() and line not in covered.get(str(Path(filename).resolve()), ())
    )
    assert tracer.entered
    assert not missed, f"{PATH_FILE.name} misses functions a GET runs: {missed}"
