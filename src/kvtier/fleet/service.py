"""``kvtier route``: routing scores from the cluster index over HTTP, for a
router to call, behind a bearer token and bounded bodies.

See docs/fleet.md, 'kvtier route CONFIG', for the requests and answers.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvtier.fleet.routing import FleetIndex
from kvtier.keys import ChunkKey
from kvtier.layout import KEY_BYTES

logger = logging.getLogger(__name__)

#: Seconds a connection may stay silent before it is closed (it holds a thread meanwhile).
REQUEST_TIMEOUT_S = 5.0


class BadRequest(ValueError):
    """A request the service refuses, with the status to answer."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class RouteService:
    """The HTTP service over a :class:`FleetIndex`, on its own threads."""

    def __init__(
        self,
        fleet: FleetIndex,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None,
        max_body_bytes: int = 1 << 20,
        max_chunks: int = 4096,
        max_connections: int = 64,
    ) -> None:
        """``token``: the bearer token requests must carry; ``None`` accepts any
        request (the caller decides whether that is acceptable)."""
        self.fleet = fleet
        self.token = token
        self.max_body_bytes = max_body_bytes
        self.max_chunks = max_chunks
        self.answered = 0
        self.refused = 0
        self._server = _BoundedServer((host, port), _handler_class(self), max_connections)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> RouteService:
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="kvtier-route", daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()

    def counts(self) -> dict[str, int]:
        """Requests answered and refused, and what the index reader saw."""
        index = self.fleet.index.counters
        return {
            "answered": self.answered,
            "refused": self.refused,
            "index_queries": index.queries,
            "index_query_failures": index.query_failures,
            "malformed_entries": index.malformed_entries,
        }

    # The request, checked ----------------------------------------------------

    def authorized(self, header: str | None) -> bool:
        if self.token is None:
            return True
        scheme, _, given = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), self.token.encode()
        )

    def answer(self, request: Any) -> dict[str, object]:
        """The scores for a decoded request body (raises :class:`BadRequest`)."""
        if not isinstance(request, dict):
            raise BadRequest(HTTPStatus.BAD_REQUEST, "expected a JSON object")
        unknown = set(request) - {"tokens", "keys"}
        if unknown or len(request) != 1:
            raise BadRequest(
                HTTPStatus.BAD_REQUEST, "send exactly one of 'tokens' (ints) and 'keys' (hex)"
            )
        keys = self._keys(request)
        scores = self.fleet.scores(keys)
        return {
            "chunk_tokens": self.fleet.chunk_tokens,
            "chunks": len(keys),
            "nodes": [score.as_dict() for score in scores],
        }

    def _keys(self, request: dict[str, Any]) -> list[ChunkKey]:
        if "keys" in request:
            raw = request["keys"]
            if not isinstance(raw, list) or not all(isinstance(k, str) for k in raw):
                raise BadRequest(HTTPStatus.BAD_REQUEST, "'keys' must be a list of hex strings")
            self._check_count(len(raw))
            try:
                keys = [ChunkKey(bytes.fromhex(k)) for k in raw]
            except ValueError:
                raise BadRequest(HTTPStatus.BAD_REQUEST, "'keys' holds a non-hex string") from None
            if any(len(k) != KEY_BYTES for k in keys):
                raise BadRequest(
                    HTTPStatus.BAD_REQUEST,
                    f"a chunk key is {KEY_BYTES} bytes ({2 * KEY_BYTES} hex)",
                )
            return keys
        tokens = request["tokens"]
        if not isinstance(tokens, list) or not all(
            type(t) is int and 0 <= t < 1 << 63 for t in tokens
        ):
            raise BadRequest(HTTPStatus.BAD_REQUEST, "'tokens' must be a list of token ids")
        if self.fleet.layout is None:
            raise BadRequest(
                HTTPStatus.BAD_REQUEST, "this service has no layout to hash tokens: send 'keys'"
            )
        self._check_count(len(tokens) // self.fleet.chunk_tokens)
        return self.fleet.keys_of(tokens)

    def _check_count(self, chunks: int) -> None:
        if chunks > self.max_chunks:
            raise BadRequest(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"{chunks} chunks asked about; at most {self.max_chunks}",
            )


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once: past
    them a new connection is closed unanswered, so slow or idle clients
    cannot pile up threads (a connection silent for :data:`REQUEST_TIMEOUT_S`
    is closed)."""

    def __init__(self, address: tuple[str, int], handler: Any, max_connections: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _handler_class(service: RouteService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S
        # A reply's headers and body go out in separate writes: with Nagle's
        # algorithm the body would wait for the client's delayed ACK (40 ms).
        disable_nagle_algorithm = True
        protocol_version = "HTTP/1.1"
        server_version = "kvtier-route"

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("route: %s " + format, self.address_string(), *args)

        def do_GET(self) -> None:
            if self.path == "/healthz":
                self._reply(HTTPStatus.OK, {"ok": True, **service.counts()})
            else:
                self._refuse(HTTPStatus.NOT_FOUND, "unknown path; POST /v1/scores")

        def do_POST(self) -> None:
            if self.path != "/v1/scores":
                self._refuse(HTTPStatus.NOT_FOUND, "unknown path; POST /v1/scores")
                return
            if not service.authorized(self.headers.get("Authorization")):
                self._refuse(HTTPStatus.UNAUTHORIZED, "a valid bearer token is required")
                return
            try:
                body = self._body()
                request = json.loads(body)
            except BadRequest as exc:
                self._refuse(exc.status, str(exc))
                return
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                self._refuse(HTTPStatus.BAD_REQUEST, "the body is not valid JSON")
                return
            try:
                answer = service.answer(request)
            except BadRequest as exc:
                self._refuse(exc.status, str(exc))
                return
            except Exception as exc:
                logger.warning("route: the cluster index did not answer: %r", exc)
                self._refuse(HTTPStatus.SERVICE_UNAVAILABLE, "the cluster index did not answer")
                return
            service.answered += 1
            self._reply(HTTPStatus.OK, answer)

        def _body(self) -> bytes:
            length_text = self.headers.get("Content-Length")
            if self.headers.get("Transfer-Encoding") or length_text is None:
                raise BadRequest(HTTPStatus.LENGTH_REQUIRED, "send a Content-Length")
            if not (length_text.isascii() and length_text.isdigit()):
                raise BadRequest(HTTPStatus.BAD_REQUEST, "a bad Content-Length")
            length = int(length_text)
            if length > service.max_body_bytes:
                raise BadRequest(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"the body is {length} bytes; at most {service.max_body_bytes}",
                )
            return self.rfile.read(length)

        def _refuse(self, status: HTTPStatus, message: str) -> None:
            service.refused += 1
            # What was not read of the body stays unread: the connection ends.
            self.close_connection = True
            self._reply(status, {"error": message})

        def _reply(self, status: HTTPStatus, payload: dict[str, object]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

    return Handler
