"""Run vLLM's own fs-tier tests (``tests/v1/kv_offload/tiering/test_fs_tier.py``
of a vLLM source release) against kvtier's adapter with a kvtier ``fs`` tier.

Every ``FileSystemTierManager`` those tests build becomes a
``KVTierSecondaryTier`` built from the same arguments, so the tests that go
through vLLM's ``SecondaryTierManager`` contract check kvtier's tier; the
tests that read the vLLM tier's internals (its file mapper, thread pool,
lookup manager, C extension) fail with an AttributeError and are listed as
such. Run it in the vLLM environment::

    pip download --no-deps --no-binary :all: --no-build-isolation vllm==0.32.0  # or any copy
    tar xzf vllm-0.32.0.tar.gz vllm-0.32.0/tests
    .venv-vllm/bin/python scripts/vllm_upstream_tiering.py vllm-0.32.0
"""

from __future__ import annotations

import sys
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


class _Substitute:
    """A pytest plugin: the test module's fs tier is kvtier's, for every test."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "FileSystemTierManager"):
            module.FileSystemTierManager = _AsKVTierFs


class _Outcomes:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or (report.when == "setup" and not report.passed):
            why = ""
            if report.failed:
                why = str(report.longrepr).strip().splitlines()[-1][:140]
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
