"""Skips, with the install hint, for tests that need a server kvtier does not ship."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from tests.support.servers import mooncake_binary


def need_redis_server() -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server/redis-cli not installed (Debian: apt-get install redis-server)")
    if importlib.util.find_spec("redis") is None:
        pytest.skip("redis-py not installed: pip install 'kvtier[redis]'")


def need_s3_server() -> None:
    for module, hint in (("moto", "moto[server]"), ("boto3", "kvtier[obj]")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} not installed: pip install '{hint}'")


def need_mooncake() -> None:
    if importlib.util.find_spec("mooncake") is None or mooncake_binary("mooncake_master") is None:
        pytest.skip(
            "Mooncake not installed: pip install 'kvtier[mooncake]' "
            "(Debian also needs: apt-get install libibverbs1)"
        )
