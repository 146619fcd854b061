"""Two engine processes share chunks through one Redis server and one bucket."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.servers import RedisServer, S3Server

ENGINE = Path(__file__).with_name("shared_engine.py")


def run_engine(config: Path, mode: str, out: Path) -> dict[str, int]:
    done = subprocess.run(
        [sys.executable, str(ENGINE), str(config), mode, str(out)],
        capture_output=True,
        text=True,
        timeout=120,  # a safety net against a hung child, not a measure
    )
    assert done.returncode == 0, done.stderr
    stats: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return stats


@pytest.fixture(params=["redis", "obj"])
def shared_tier(request: pytest.FixtureRequest, key_prefix: str) -> dict[str, Any]:
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        return {"type": "redis", "url": server.url, "key_prefix": key_prefix}
    s3: S3Server = request.getfixturevalue("s3_server")
    bucket: str = request.getfixturevalue("s3_bucket")
    return {"type": "obj", **s3.tier_options(bucket)}


def test_chunks_stored_by_one_engine_load_byte_exact_in_another(
    shared_tier: dict[str, Any], tmp_path: Path
) -> None:
    config = tmp_path / "kvtier.json"
    config.write_text(
        json.dumps(
            {"chunk_tokens": 8, "cpu_bytes_to_use": "4MiB", "secondary_tiers": [shared_tier]}
        )
    )
    first = run_engine(config, "store", tmp_path / "stored.npy")
    assert first["chunks_stored"] == 6 and first["store_failures"] == 0
    second = run_engine(config, "load", tmp_path / "loaded.npy")
    assert second["chunks_loaded"] == 6 and second["hits"] >= 6
    stored = np.load(tmp_path / "stored.npy")
    loaded = np.load(tmp_path / "loaded.npy")
    assert loaded.shape == stored.shape
    np.testing.assert_array_equal(loaded, stored)
