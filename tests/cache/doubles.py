"""Test doubles for manager tests: tiers whose timing the test controls."""

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvtier.tiers.base import JobResult, TransferJob
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


class HookedTier(RecordingTier):
    """The example tier, calling :attr:`after_submit` once each job is in the tier's hands.

    The example tier finishes a job inside ``submit``, so a hook that
    collects results sees it finished before ``submit`` returns.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.after_submit: Callable[[], None] | None = None

    def submit_store(self, job: TransferJob) -> None:
        super().submit_store(job)
        if self.after_submit is not None:
            self.after_submit()

    def submit_load(self, job: TransferJob) -> None:
        super().submit_load(job)
        if self.after_submit is not None:
            self.after_submit()


class MalformingTier(RecordingTier):
    """The example tier; while :attr:`malform` is set, the first result of each
    batch it reports is malformed (``succeeded`` is not a set of keys)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.malform = False

    def get_finished_jobs(self) -> list[JobResult]:
        results = super().get_finished_jobs()
        if self.malform and results:
            results[0] = replace(results[0], succeeded=None)  # type: ignore[arg-type]
        return results


class RaisingTier(RecordingTier):
    """The example tier; its ``submit_<raise_in>`` raises :attr:`error` (any
    exception class, ``BaseException`` ones included) while :attr:`raise_in`
    is set, and only once when :attr:`once` is."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.raise_in: str | None = None
        self.error: type[BaseException] = RuntimeError
        self.once = False

    def _raise(self, where: str) -> None:
        if self.raise_in == where:
            if self.once:
                self.raise_in = None
            raise self.error(f"submit_{where} raised (injected)")

    def submit_store(self, job: TransferJob) -> None:
        self._raise("store")
        super().submit_store(job)

    def submit_load(self, job: TransferJob) -> None:
        self._raise("load")
        super().submit_load(job)
