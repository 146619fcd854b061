"""Per-tier store backpressure: a latency moving average with hysteresis."""

from __future__ import annotations

from kvtier.config.sections import BackpressureConfig


class Backpressure:
    """Decides whether a tier takes another store job.

    A tier is *pressured* once its average seconds per stored chunk rises
    above ``high_latency_s``, and stays so until it falls below
    ``low_latency_s``: the gap keeps it from flapping. A pressured tier with
    nothing in flight still takes one probe job, so the average can recover.
    Not thread-safe on its own: the manager calls it under its lock.
    """

    def __init__(self, config: BackpressureConfig) -> None:
        self.config = config
        self.average: float | None = None
        self.pressured = False
        self.inflight = 0

    def admit(self) -> bool:
        if self.inflight >= self.config.max_inflight_stores:
            return False
        return not (self.pressured and self.inflight > 0)

    def started(self) -> None:
        self.inflight += 1

    def cancelled(self) -> None:
        """A started job ended without a measurement (it failed to submit or to report)."""
        self.inflight -= 1

    def finished(self, seconds_per_chunk: float) -> None:
        self.inflight -= 1
        alpha = self.config.smoothing
        self.average = (
            seconds_per_chunk
            if self.average is None
            else alpha * seconds_per_chunk + (1 - alpha) * self.average
        )
        if self.average > self.config.high_latency_s:
            self.pressured = True
        elif self.average < self.config.low_latency_s:
            self.pressured = False
