"""Lifecycle: a call and a close that race, forced into the interleaving
where the call has counted itself but not yet looked at the close."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.errors import ClosedError
from kvtier.lifecycle import Lifecycle


def test_a_call_counted_as_a_close_begins_backs_out_and_the_close_returns() -> None:
    lifecycle = Lifecycle("thing")
    closer = threading.Thread(target=lifecycle.close)
    raced: list[bool] = []

    class CloseOnFirstCount(dict[int, int]):
        def __setitem__(self, thread: int, depth: int) -> None:
            super().__setitem__(thread, depth)
            if not raced:  # the call has counted itself: the close begins now
                raced.append(True)
                closer.start()
                while not lifecycle.closed:
                    time.sleep(0)  # yield to the closer

    lifecycle._running = CloseOnFirstCount()
    entered = []
    with pytest.raises(ClosedError, match="thing is closed"), lifecycle.running():
        entered.append(True)
    closer.join()
    # The call never ran past the close, and the close did not wait for it in vain.
    assert raced and not entered and not lifecycle._running
    with pytest.raises(ClosedError):
        lifecycle.running().__enter__()
