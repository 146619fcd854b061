"""``kvtier route``: routing scores over HTTP, and what it refuses."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from kvtier.cli import cli
from kvtier.cli.probe import probe_layout
from kvtier.fleet import FleetIndex
from kvtier.fleet.base import NodeLease
from kvtier.fleet.service import RouteService
from kvtier.keys import chunk_keys
from tests.fleet import fleet_doubles
from tests.support.servers import RedisServer

CHUNK_TOKENS = 16
LAYOUT = probe_layout(CHUNK_TOKENS, 16)
TOKEN = "route-token-0123456789"


@pytest.fixture
def service() -> Iterator[RouteService]:
    fleet_doubles.STORE = fleet_doubles.DictStore()
    index = fleet_doubles.DictIndex(fleet_doubles.DictIndexOptions())
    tokens = np.arange(CHUNK_TOKENS * 3)
    keys = list(chunk_keys(LAYOUT.namespace, tokens, CHUNK_TOKENS))
    index.publish(
        "00000000000000a1", NodeLease("a", "127.0.0.1:7001"), [(k, "cpu") for k in keys], []
    )
    index.publish("00000000000000b2", NodeLease("b", None), [(keys[0], "fs")], [])
    fleet = FleetIndex(index, CHUNK_TOKENS, LAYOUT)
    running = RouteService(fleet, token=TOKEN, max_body_bytes=4096, max_chunks=64).start()
    yield running
    running.close()


def post(
    service: RouteService, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    host, port = service.address
    conn = http.client.HTTPConnection(host, port, timeout=30)
    sent = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/scores", body=body, headers={**sent, **(headers or {})})
    response = conn.getresponse()
    payload = json.loads(response.read())
    conn.close()
    return response.status, payload


def test_scores_for_tokens_and_for_keys(service: RouteService) -> None:
    tokens = list(range(CHUNK_TOKENS * 3))
    status, answer = post(service, json.dumps({"tokens": tokens}).encode())
    assert status == 200
    assert answer == {
        "chunk_tokens": CHUNK_TOKENS,
        "chunks": 3,
        "nodes": [
            {"node": "a", "p2p": "127.0.0.1:7001", "tokens": {"any": 48, "cpu": 48}},
            {"node": "b", "p2p": None, "tokens": {"any": 16, "fs": 16}},
        ],
    }
    keys = [k.hex() for k in chunk_keys(LAYOUT.namespace, np.arange(32), CHUNK_TOKENS)]
    status, answer = post(service, json.dumps({"keys": keys}).encode())
    assert status == 200 and answer["nodes"][0]["tokens"] == {"any": 32, "cpu": 32}


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b'{"tokens": [1.5]}', 400),
        (b'{"tokens": [-1]}', 400),
        (b'{"keys": ["zz"]}', 400),
        (b'{"keys": ["abcd"]}', 400),
        (b'{"tokens": [1], "keys": []}', 400),
        (b"[" * 3000 + b"]" * 3000, 413),
        (json.dumps({"tokens": list(range(CHUNK_TOKENS * 65))}).encode(), 413),
    ],
)
def test_malformed_or_oversized_requests_get_a_4xx(
    service: RouteService, body: bytes, status: int
) -> None:
    got, answer = post(service, body)
    assert got == status and "error" in answer


def test_a_request_without_the_token_is_refused(service: RouteService) -> None:
    status, _ = post(service, b'{"tokens": []}', {"Authorization": "Bearer wrong"})
    assert status == 401


def test_an_oversized_body_is_refused_before_it_is_read(service: RouteService) -> None:
    host, port = service.address
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.sendall(
            b"POST /v1/scores HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
            b"Content-Length: 1000000000\r\n\r\n"
        )  # and never a byte of the body
        reply = conn.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413")


def test_a_body_without_a_length_is_refused(service: RouteService) -> None:
    host, port = service.address
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.sendall(
            b"POST /v1/scores HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n"
        )
        reply = conn.recv(65536)
    assert reply.startswith(b"HTTP/1.1 411")


def test_connections_past_the_bound_are_closed_unanswered(service: RouteService) -> None:
    bounded = RouteService(service.fleet, token=TOKEN, max_connections=1).start()
    host, port = bounded.address
    try:
        idle = socket.create_connection((host, port), timeout=30)  # takes the only slot
        refused = socket.create_connection((host, port), timeout=30)
        assert refused.recv(1024) == b""  # closed without an answer
        refused.close()
        idle.close()
        deadline = time.monotonic() + 30  # safety net: the slot comes back with the close
        while True:
            try:
                status, _ = post(bounded, b'{"tokens": []}')
                break
            except (ConnectionError, http.client.RemoteDisconnected):
                assert time.monotonic() < deadline, "the slot never came back"
                time.sleep(0.01)
        assert status == 200
    finally:
        bounded.close()


def test_an_index_that_fails_answers_503(service: RouteService) -> None:
    fleet_doubles.STORE.failing = True
    status, answer = post(service, b'{"tokens": []}')
    assert status == 503 and "index" in answer["error"]
    host, port = service.address
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", "/healthz")  # no token needed
    health = json.loads(conn.getresponse().read())
    conn.close()
    assert health["ok"] and health["refused"] == 1 and health["answered"] == 0


def test_the_command_refuses_to_serve_unauthenticated_beyond_loopback(tmp_path: Any) -> None:
    config = tmp_path / "kvtier.json"
    config.write_text(json.dumps({"index": {"type": "redis", "url": "redis://127.0.0.1:1/0"}}))
    result = CliRunner().invoke(cli, ["route", str(config), "--host", "0.0.0.0", "--no-auth"])
    assert result.exit_code == 2 and "non-loopback" in result.output
    result = CliRunner(env={"KVTIER_ROUTE_TOKEN": ""}).invoke(cli, ["route", str(config)])
    assert result.exit_code == 2 and "KVTIER_ROUTE_TOKEN" in result.output


def test_the_command_serves_scores_from_redis(tmp_path: Any, redis_server: RedisServer) -> None:
    from kvtier.config import load_config
    from kvtier.fleet import build_index

    section = {"type": "redis", "url": redis_server.url, "key_prefix": "t-route-cli:"}
    config_path = tmp_path / "kvtier.json"
    config_path.write_text(json.dumps({"chunk_tokens": CHUNK_TOKENS, "index": section}))
    loaded = load_config({"index": section})
    assert loaded.index is not None
    index = build_index(loaded.index.index_class, loaded.index.options)
    keys = list(chunk_keys(LAYOUT.namespace, np.arange(CHUNK_TOKENS * 2), CHUNK_TOKENS))
    index.publish("00000000000000d1", NodeLease("engine-d", None), [(k, "cpu") for k in keys], [])
    command = [sys.executable, "-c", "from kvtier.cli import main; main()", "route"]
    command += [str(config_path), "--port", "0"]
    env = {**os.environ, "KVTIER_ROUTE_TOKEN": TOKEN}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("listening on 127.0.0.1:"), line
        host, _, port = line.split()[-1].rpartition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        body = json.dumps({"keys": [k.hex() for k in keys]})
        conn.request("POST", "/v1/scores", body=body, headers={"Authorization": f"Bearer {TOKEN}"})
        answer = json.loads(conn.getresponse().read())
        conn.close()
        assert answer["nodes"] == [
            {"node": "engine-d", "p2p": None, "tokens": {"any": 32, "cpu": 32}}
        ]
    finally:
        process.terminate()
        process.wait(60)
        index.withdraw("00000000000000d1")
        index.close()
