"""Run vLLM's own fs-tier tests (``tests/v1/kv_offload/tiering/test_fs_tier.py``
of a vLLM source release) against kvtier's adapter with a kvtier ``fs`` tier.

Every ``FileSystemTierManager`` those tests build becomes a
``KVTierSecondaryTier`` built from the same arguments, so the tests that go
through vLLM's ``SecondaryTierManager`` contract check kvtier's tier; the
tests that read the vLLM tier's internals (its file mapper, thread pool,
event list) fail with an AttributeError and are listed as such. The tests'
own helper that waits for lookups (it peeks at the vLLM tier's lookup
manager) steps the tier through its public calls instead. Run it in the vLLM environment::

    pip download --no-deps --no-binary :all: --no-build-isolation vllm==0.32.0  # or any copy
    tar xzf vllm-0.32.0.tar.gz vllm-0.32.0/tests
    .venv-vllm/bin/python scripts/vllm_upstream_tiering.py vllm-0.32.0
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest


class _AsKVTierFs:
    """Builds kvtier's adapter from the arguments of vLLM's fs tier."""

    def __new__(  # type: ignore[misc]
        cls,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        n_read_threads: int = 16,
        n_write_threads: int = 16,
        enable_kv_events: bool = False,
        locality: str | None = None,
        backpressure_detector: Any = None,
    ) -> Any:
        from kvtier.integrations.vllm.tiering import KVTierSecondaryTier

        return KVTierSecondaryTier(
            offloading_spec,
            primary_kv_view,
            tier_type,
            backpressure_detector,
            tier={
                "type": "fs",
                "root_dir": root_dir,
                "io_threads": max(n_read_threads, n_write_threads),
            },
            enable_kv_events=enable_kv_events,
            locality=locality,
        )


def _lookup_and_wait(
    tier: Any, keys: list[Any], ctx: Any = None, timeout: float = 5.0
) -> list[Any]:
    """The tests' own waiting helper, without the vLLM tier's lookup internals
    it peeks at: step until no lookup answers RETRY."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

    ctx = ctx or ReqContext(req_id="test")
    deadline = time.monotonic() + timeout
    while True:
        answers = [tier.lookup(key, ctx) for key in keys]
        if LookupResult.RETRY not in answers or time.monotonic() > deadline:
            return answers
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
        time.sleep(0.01)


class _Substitute:
    """A pytest plugin: the test module's fs tier is kvtier's, for every test,
    and its lookup helper waits through the tier's own calls."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "FileSystemTierManager"):
            module.FileSystemTierManager = _AsKVTierFs
            module.lookup_and_wait = _lookup_and_wait


class _Outcomes:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or (report.when == "setup" and not report.passed):
            why = ""
            if report.failed:
                crash = getattr(report.longrepr, "reprcrash", None)
                message = crash.message if crash is not None else str(report.longrepr)
                why = message.strip().splitlines()[0][:120].replace("|", "/")
            self.rows.append((report.nodeid.split("::")[-1], report.outcome, why))


def main(argv: list[str]) -> int:
    source = Path(argv[0] if argv else "vllm-0.32.0")
    test_file = source / "tests/v1/kv_offload/tiering/test_fs_tier.py"
    if not test_file.is_file():
        raise SystemExit(f"{test_file} not found: give the path of a vLLM source release")
    outcomes = _Outcomes()
    pytest.main(
        ["-q", "--noconftest", "-p", "no:cacheprovider", str(test_file)],
        plugins=[_Substitute(), outcomes],
    )
    print("| upstream test | result | why |")
    print("|---|---|---|")
    for name, outcome, why in outcomes.rows:
        print(f"| `{name}` | {outcome} | {why} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
