"""Waiting for promotions without polling: a mark that moves whenever a lookup's
answer may have changed (a tier's job ended or a check answered, a store completed)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable

from kvtier.tiers.base import SecondaryTier

__all__ = ["Progress"]

logger = logging.getLogger(__name__)

#: Longest sleep of :meth:`Progress.sleep` between looks when every tier
#: announces: it only covers a change nobody announced.
UNANNOUNCED_S = 0.05
#: Once woken, a waiter sleeps this many times as long as its last look
#: took before it looks again (at most ``UNANNOUNCED_S``): looking costs
#: it at most 1 / (1 + LOOK_SPACING) of a core, but for looks longer than
#: UNANNOUNCED_S / LOOK_SPACING.
LOOK_SPACING = 7.0


class Progress:
    """Take :attr:`mark` before a lookup, then :meth:`wait` past it."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        pause: Callable[[float], None] = time.sleep,
    ) -> None:
        # The clock and the plain sleep of :meth:`sleep` (tests replace them).
        self._clock, self._pause = clock, pause
        self._changed = threading.Condition(threading.Lock())
        #: Moves past every value it had whenever something a lookup may find
        #: changed. Read-only to callers (a plain attribute: read by every lookup).
        self.mark = 0
        # Each announce takes the next mark (``next`` is atomic): no lock
        # unless a thread waits. An announce moves the mark, then looks for
        # waiters; a waiter counts itself, then looks at the mark: one of
        # the two always sees the other, so no wake is lost.
        self._marks = itertools.count(1)
        # Threads in wait (changed under the condition's lock).
        self._waiting = 0
        #: Whether every followed tier announces its progress (else waiters poll).
        self.announced = True
        #: The longest look spacing of :meth:`sleep`.
        self.max_spacing_s = UNANNOUNCED_S

    def follow(self, tiers: Iterable[SecondaryTier]) -> None:
        """Ask each tier to :meth:`announce` its progress, up to one that will not."""
        self.announced = all(self._listens(tier) for tier in tiers)

    def _listens(self, tier: SecondaryTier) -> bool:
        try:
            return tier.set_progress_listener(self.announce) is True
        except Exception:
            logger.exception("tier %s: set_progress_listener raised", tier.tier_type)
            return False

    def announce(self) -> None:
        """Something a lookup may find changed: wake the waiters."""
        self.mark = next(self._marks)
        if self._waiting:
            with self._changed:
                self._changed.notify_all()

    def wait(self, mark: int, timeout: float) -> bool:
        """Block until :attr:`mark` moves past ``mark`` or ``timeout`` seconds
        pass; whether it moved. Tiers that do not announce their progress
        (:attr:`announced`) never move it: poll them."""
        with self._changed:
            self._waiting += 1
            try:
                return self._changed.wait_for(lambda: self.mark != mark, timeout)
            finally:
                self._waiting -= 1

    def sleep(self, mark: int, left: float, poll_s: float, looked_s: float = 0.0) -> None:
        """Sleep until :attr:`mark` may have moved past ``mark``, at most
        ``left`` seconds: woken by an announcement where every tier makes
        them (bounded by :data:`UNANNOUNCED_S`), else after ``poll_s``.

        ``looked_s``: how long the caller's last look took. Once woken it
        sleeps :data:`LOOK_SPACING` times that more, within ``left``, so that
        announcements arriving faster than it can look (a check answering
        per chunk of a long prefix) are taken a batch at a time, and its
        looks hold the interpreter lock a bounded share of the time. (Sleeping
        only what a late wake left of it made half as many looks again over
        a cold ``obj`` prefix: see docs/tuning.md.) At most :attr:`max_spacing_s`.
        """
        # Capped: only a look starts the promotions of chunks whose checks
        # answered meanwhile, so a long spacing idles the tier once those in
        # flight end (a 15 ms look over 2,048 chunks being checked, then 0.1 s idle).
        spacing = min(LOOK_SPACING * looked_s, self.max_spacing_s)
        if self.announced:
            started = self._clock()
            self.wait(mark, min(left, max(poll_s, UNANNOUNCED_S)))
            spacing = min(spacing, left - (self._clock() - started))
            if spacing > 0:
                self._pause(spacing)
        else:
            self._pause(min(left, max(poll_s, spacing)))
