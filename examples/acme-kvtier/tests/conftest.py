from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _in_a_fresh_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts in its own directory, so relative database paths are private."""
    monkeypatch.chdir(tmp_path)
