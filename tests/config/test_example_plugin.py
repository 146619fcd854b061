"""The example package in examples/acme-kvtier, installed, loads both ways.

``scripts/test.sh`` installs it (``pip install -e examples/acme-kvtier``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import ConfigError, KVCache, load_config
from kvtier.plugins import ALLOWED_MODULES_ENV
from kvtier.testing import restore_registries, small_layout
from kvtier.tiers import tier_registry
from tests.support.round_trip import assert_served_after_primary_reset

pytest.importorskip(
    "acme_kvtier", reason="example tier not installed: pip install -e examples/acme-kvtier"
)

WARNING = "Loading an out-of-tree secondary tier. This interface is experimental"
INFO = "Loading out-of-tree secondary tier 'SQLiteTier' from module 'acme_kvtier.sqlite_tier'"


@pytest.fixture
def fresh_process(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Registries as a new process has them: the once-per-process warning not yet given."""
    caplog.set_level(logging.INFO, logger="kvtier.plugins")
    with restore_registries():
        yield caplog


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def entry_via_entry_point(tmp_path: Path) -> dict[str, Any]:
    return {"type": "acme_sqlite", "path": str(tmp_path / "ep.sqlite3")}


def entry_via_module_path(tmp_path: Path) -> dict[str, Any]:
    return {
        "type": "SQLiteTier",
        "module_path": "acme_kvtier.sqlite_tier",
        "path": str(tmp_path / "mp.sqlite3"),
    }


def test_the_package_declares_its_entry_point() -> None:
    [point] = entry_points(group="kvtier.tiers", name="acme_sqlite")
    assert point.value == "acme_kvtier.sqlite_tier:SQLiteTier"
    assert "acme_sqlite" in tier_registry.names()


@pytest.mark.parametrize("entry", [entry_via_entry_point, entry_via_module_path])
def test_loads_with_one_warning_per_process_and_one_info_line_per_load(
    fresh_process: pytest.LogCaptureFixture, tmp_path: Path, entry: Any
) -> None:
    from acme_kvtier import SQLiteTier

    config = load_config({"secondary_tiers": [entry(tmp_path), entry(tmp_path)]})
    assert [t.tier_class for t in config.secondary_tiers] == [SQLiteTier, SQLiteTier]
    load_config({"secondary_tiers": [entry(tmp_path)]})
    warnings = [m for m in messages(fresh_process, logging.WARNING) if WARNING in m]
    assert len(warnings) == 1
    assert messages(fresh_process, logging.INFO).count(INFO) == 3


def test_serves_a_prefix_through_kvcache_with_its_metrics(tmp_path: Path) -> None:
    layout = small_layout(chunk_tokens=4)
    tokens = list(range(12))
    data = np.random.default_rng(3).integers(0, 256, (3, layout.slot_bytes), dtype=np.uint8)
    settings = {
        "chunk_tokens": 4,
        "cpu_bytes_to_use": 4 * layout.slot_bytes,
        "secondary_tiers": [entry_via_module_path(tmp_path)],
    }
    with restore_registries(), KVCache(settings, layout) as cache:
        assert_served_after_primary_reset(cache, tokens, data)
        registry = cache.metrics.registry
        labels = {"tier": "0", "tier_type": "SQLiteTier"}
        assert registry.get_sample_value("kvtier_tier_chunks_loaded_total", labels) == 3
        held = registry.get_sample_value("kvtier_tier_sqlite_held_bytes", labels)
        assert held is not None and held > 3 * layout.slot_bytes


def test_allowed_modules_confine_module_path_but_not_installed_entry_points(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with restore_registries():
        monkeypatch.setenv(ALLOWED_MODULES_ENV, "corp_tiers")
        with pytest.raises(ConfigError, match="not allowed by KVTIER_ALLOWED_MODULES"):
            load_config({"secondary_tiers": [entry_via_module_path(tmp_path)]})
        # An installed entry point was vetted when the package was installed.
        load_config({"secondary_tiers": [entry_via_entry_point(tmp_path)]})
        monkeypatch.setenv(ALLOWED_MODULES_ENV, "corp_tiers, acme_kvtier")
        load_config({"secondary_tiers": [entry_via_module_path(tmp_path)]})
