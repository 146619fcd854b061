"""Test doubles for manager tests: tiers whose timing the test controls."""

from typing import Any

from kvtier.tiers.base import TransferJob
from kvtier.tiers.example import ExampleTier


class RecordingTier(ExampleTier):
    """The example tier, recording every job it is given."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stores: list[TransferJob] = []
        self.loads: list[TransferJob] = []

    def submit_store(self, job: TransferJob) -> None:
        self.stores.append(job)
        super().submit_store(job)

    def submit_load(self, job: TransferJob) -> None:
        self.loads.append(job)
        super().submit_load(job)


class GatedTier(RecordingTier):
    """Holds every job until the test calls :meth:`release` (or the tier drains)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.held: list[tuple[bool, TransferJob]] = []

    def submit_store(self, job: TransferJob) -> None:
        self.stores.append(job)
        self.held.append((False, job))

    def submit_load(self, job: TransferJob) -> None:
        self.loads.append(job)
        self.held.append((True, job))

    def release(self) -> None:
        held, self.held = self.held, []
        for loading, job in held:
            (ExampleTier.submit_load if loading else ExampleTier.submit_store)(self, job)

    def drain(self) -> None:
        self.release()
