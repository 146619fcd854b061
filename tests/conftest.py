"""Fixtures shared by kvtier's tests."""

from collections.abc import Iterator

import pytest

from kvtier.testing import restore_registries


@pytest.fixture
def registries() -> Iterator[None]:
    """Let a test register plugins (and trip once-per-process warnings) in isolation."""
    with restore_registries():
        yield
