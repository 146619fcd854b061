"""Fixtures of the fs tier's tests: a root directory and a tier open on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.testing import TierHarness
from kvtier.tiers.fs import FilesystemTier
from tests.tiers.fs.fs_support import open_tier


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The tier's root directory, not yet created."""
    return tmp_path / "kv"


@pytest.fixture
def fs_options() -> dict[str, Any]:
    """Options of the ``harness`` tier beyond its root; override per module."""
    return {}


@pytest.fixture
def harness(root: Path, fs_options: dict[str, Any]) -> Iterator[TierHarness[FilesystemTier]]:
    """An fs tier on ``root`` with its index loaded, shut down after the test."""
    opened = open_tier(root, **fs_options)
    yield opened
    opened.close()
