"""A bound on calls that may never return, for the contract suites: each call
runs on a daemon thread, and one that does not return in time fails the
test, naming the class and method. A guard against hangs, not a speed check.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import TypeVar

import pytest

from kvtier.tiers.deadlines import CallTimeout, call_within

T = TypeVar("T")

#: The default bound, in seconds, on one call into a tier or policy.
DEFAULT_CALL_TIMEOUT_S = 120.0


class HangGuard:
    """Runs calls into instances of ``plugin`` with a bound of ``timeout_s`` each.

    ``guard(step, call)`` returns what ``call()`` returns, or fails the test
    when it has not returned after ``timeout_s``. ``step`` is the method the
    call makes (``"drain"``), or what it does (a test's name) when it makes
    several. ``setting`` names, in the failure, where to raise the bound.
    """

    def __init__(self, plugin: type, timeout_s: float, *, setting: str = "call_timeout_s") -> None:
        if not timeout_s > 0:
            raise ValueError(f"{setting} must be positive, got {timeout_s!r}")
        self.plugin = plugin
        self.timeout_s = timeout_s
        self.setting = setting

    def __call__(self, step: str, call: Callable[[], T]) -> T:
        worker: list[int] = []
        returned = threading.Event()

        def run() -> T:
            worker.append(threading.get_ident())
            try:
                return call()
            finally:
                returned.set()

        name = f"hang guard: {self.plugin.__qualname__}.{step}"
        try:
            return call_within(run, self.timeout_s, name=name)
        except CallTimeout:
            if returned.is_set():  # the call's own CallTimeout, not ours
                raise
            method = self._method_running(worker[0] if worker else None)
            if method is None and hasattr(self.plugin, step):
                method = step
            where = self.plugin.__qualname__
            stuck = f"{where}.{method}" if method else f"{step} (with {where})"
            pytest.fail(
                f"{stuck} did not return within "
                f"{self.timeout_s:g}s: it hangs, or is slower than this hang guard "
                f"allows (raise {self.setting}).",
                pytrace=False,
            )

    def _method_running(self, thread_id: int | None) -> str | None:
        """The outermost method of ``plugin`` on that thread's stack, if any:
        the one the suite called (a hang deeper inside is in its call)."""
        frame: FrameType | None = sys._current_frames().get(thread_id or -1)
        methods = {
            function.__code__
            for cls in self.plugin.__mro__
            if cls is not object
            for function in vars(cls).values()
            if hasattr(function, "__code__")
        }
        outermost = None
        while frame is not None:
            if frame.f_code in methods:
                outermost = frame.f_code.co_name
            frame = frame.f_back
        return outermost
