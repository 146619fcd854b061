"""Waiting for promotions without polling: a mark that moves whenever a lookup's
answer may have changed (a tier's job ended or a check answered, a store completed)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from kvtier.tiers.base import SecondaryTier

__all__ = ["Progress"]

logger = logging.getLogger(__name__)


class Progress:
    """Take :attr:`mark` before a lookup, then :meth:`wait` past it."""

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._mark = 0
        # Threads in wait: an announce with none (every store) skips the notify.
        self._waiting = 0
        #: Whether every followed tier announces its progress (else waiters poll).
        self.announced = True

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
        with self._changed:
            self._mark += 1
            if self._waiting:
                self._changed.notify_all()

    @property
    def mark(self) -> int:
        return self._mark

    def wait(self, mark: int, timeout: float) -> bool:
        """Block until :attr:`mark` moves past ``mark`` or ``timeout`` seconds
        pass; whether it moved. Tiers that do not announce their progress
        (:attr:`announced`) never move it: poll them."""
        with self._changed:
            self._waiting += 1
            try:
                return self._changed.wait_for(lambda: self._mark != mark, timeout)
            finally:
                self._waiting -= 1
