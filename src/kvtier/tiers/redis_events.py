"""Chunks a Redis server drops by itself (``maxmemory`` evictions, ``ttl_s``
expiries), heard as they go through its keyspace notifications.

Without this, residency (KV events for routers) learns of such a chunk only
when a load finds it gone. Each server of the tier (every node of a
cluster: notifications stay on the node that raised them, and a replica
raises them once it is promoted) gets one subscriber thread, on a connection
of its own, which reconnects after an outage. A cluster's nodes are listed
again every :data:`RELIST_S`: a node that joined (a reshard, a scale-out)
gets a subscriber, one that left loses its own. A server that cannot be
reached at start (a cluster node down or frozen) is subscribed to once it
answers, rather than failing the start: the tier serves without it. What a
server drops while its subscriber is away goes unheard, as before: a load
finds it gone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger(__name__)

#: The keyspace-notification classes the subscribers need: ``E`` (keyevent
#: channels), ``e`` (evicted) and ``x`` (expired).
NEEDED_FLAGS = "Exe"
#: The events heard, each on its ``__keyevent@<db>__:<event>`` channel.
EVENTS = ("evicted", "expired")
#: Most names a subscriber gathers before it reports them.
REPORT_BATCH = 256
#: Seconds a subscriber waits for a message before it looks whether it should stop.
POLL_S = 0.5
#: Seconds a subscriber waits for the server to confirm its subscriptions.
CONFIRM_S = 10.0
#: Seconds between a subscriber's attempts to reconnect, at first and at most.
RETRY_S, MAX_RETRY_S = 0.2, 5.0
#: Seconds between listings of a cluster's nodes.
RELIST_S = 10.0

#: One server to hear: ``(where, connect)``, ``where`` naming it in messages
#: (and telling servers apart), ``connect()`` giving a new client of it.
Server = tuple[str, Callable[[], Any]]


class NotificationsRefused(RuntimeError):
    """A server lacks the notifications and refused to turn them on."""


def missing_flags(flags: str) -> str:
    """The classes of :data:`NEEDED_FLAGS` that ``flags`` (a server's
    ``notify-keyspace-events``) leaves out."""
    held = set(flags) | (set("ex") if "A" in flags else set())  # A: e, x and most others
    return "".join(flag for flag in NEEDED_FLAGS if flag not in held)


def turn_on_notifications(client: Any, where: str) -> None:
    """Make sure the server behind ``client`` raises the notifications: add
    what ``notify-keyspace-events`` lacks, keeping what it has (other users of
    the server may rely on it). :class:`NotificationsRefused` if it reads
    the setting but refuses to change it.

    A server that will not say (managed services disable ``CONFIG`` and take
    the setting in their own console) is trusted, with a warning: if it
    raises nothing, drops go unheard, as without a subscriber.
    """
    from redis.exceptions import ResponseError

    try:
        [flags] = client.config_get("notify-keyspace-events").values()
    except (ResponseError, ValueError) as exc:
        logger.warning(
            "%s did not say which keyspace notifications it raises (%s): make sure its "
            "notify-keyspace-events includes %s, or no drop there is heard",
            where,
            exc,
            NEEDED_FLAGS,
        )
        return
    flags = flags.decode() if isinstance(flags, bytes) else str(flags)
    missing = missing_flags(flags)
    if not missing:
        return
    try:
        client.config_set("notify-keyspace-events", flags + missing)
    except ResponseError as exc:
        raise NotificationsRefused(
            f"{where} raises keyspace notifications {flags!r}, which lack {missing!r}, and "
            f"refused to add them ({exc}); set notify-keyspace-events to include "
            f"{NEEDED_FLAGS} there, or turn watch_evictions off"
        ) from exc


class _Subscription:
    """One server's client, and its subscription to the drop notifications."""

    def __init__(self, where: str, client: Any, channels: Sequence[str]) -> None:
        self.where, self.client = where, client
        turn_on_notifications(client, where)
        self.pubsub = client.pubsub()
        self.pubsub.subscribe(*channels)
        # Confirmed before the start goes on: a user the server does not
        # let subscribe (an ACL without these channels) fails the start.
        for channel in channels:
            reply = self.pubsub.get_message(timeout=CONFIRM_S)
            if reply is None or reply["type"] != "subscribe":
                raise ConnectionError(f"{where} did not confirm a subscription to {channel}")
        self.pubsub.ignore_subscribe_messages = True
        # redis-py reconnects a lost subscription by itself, and subscribes it
        # again: a server back from a restart may have lost the setting.
        self.pubsub.connection.register_connect_callback(self._reconnected)

    def _reconnected(self, _connection: Any) -> None:
        turn_on_notifications(self.client, self.where)

    def close(self) -> None:
        try:
            self.pubsub.close()
            self.client.close()
        except Exception as exc:
            logger.debug("closing the subscription to %s: %s", self.where, exc)


class DropWatcher:
    """Subscribers to the evictions and expiries of a tier's servers.

    Each of ``servers`` gets a subscriber, used by it alone. The names dropped
    go to ``report(event, names)``, a batch at a time; it picks out the tier's
    own. With ``relist``, the servers are listed again every
    :data:`RELIST_S` (a cluster's nodes): those new get a subscriber, those
    gone lose theirs.
    """

    def __init__(
        self,
        servers: Sequence[Server],
        db: int,
        report: Callable[[str, list[bytes]], None],
        thread_name: str,
        relist: Callable[[], Sequence[Server]] | None = None,
        start_wait_s: float = CONFIRM_S,
    ) -> None:
        self._channels = [f"__keyevent@{db}__:{event}" for event in EVENTS]
        self._report = report
        self._thread_name = thread_name
        self._lock = threading.Lock()  # the subscribers, between relisting and close
        self._closed = threading.Event()
        #: Each server's subscriber, by ``where``: its thread and what stops it.
        self._subscribers: dict[str, tuple[threading.Thread, threading.Event]] = {}
        self._retired: list[threading.Thread] = []
        self._relister: threading.Thread | None = None
        # Every server is asked at once, and the start waits for their first
        # answers (at most start_wait_s): a server that refuses fails it. One
        # that cannot be reached (a cluster node down or frozen) does not: the
        # tier serves without it, and its subscriber keeps trying.
        firsts: dict[str, Future[None]] = {}
        with self._lock:
            for where, connect in servers:
                firsts[where] = Future()
                self._start(where, connect, firsts[where])
        futures.wait(firsts.values(), timeout=start_wait_s)
        with self._lock:
            for first in firsts.values():
                first.cancel()  # no answer yet: no later one reaches the start
        for where, first in firsts.items():
            if first.cancelled():
                logger.warning(
                    "%s did not answer within %ss: its drops are heard once it answers",
                    where,
                    start_wait_s,
                )
            elif (refused := first.exception()) is not None:
                self.close()
                raise refused
        if relist is not None:
            self._relister = threading.Thread(
                target=self._relist, args=(relist,), name=thread_name, daemon=True
            )
            self._relister.start()

    def _start(
        self, where: str, connect: Callable[[], Any], first: Future[None] | None = None
    ) -> None:
        stop = threading.Event()
        thread = threading.Thread(
            target=self._listen,
            args=(where, connect, stop, first),
            name=self._thread_name,
            daemon=True,
        )
        self._subscribers[where] = (thread, stop)
        thread.start()

    def _tell_start(self, first: Future[None] | None, refused: BaseException | None) -> bool:
        """Tell the start how a server's first attempt went (``refused``: it
        fails the start), if it is still waiting; whether it was told."""
        with self._lock:
            if first is None or first.done():  # none waits, or it stopped waiting
                return False
            if refused is None:
                first.set_result(None)
            else:
                first.set_exception(refused)
            return True

    def _relist(self, relist: Callable[[], Sequence[Server]]) -> None:
        while not self._closed.wait(RELIST_S):
            try:
                listed = dict(relist())
            except Exception as exc:  # the next listing may answer
                logger.debug("listing the servers to hear the drops of: %s", exc)
                continue
            with self._lock:
                if self._closed.is_set():
                    return
                self._retired = [thread for thread in self._retired if thread.is_alive()]
                for where, connect in listed.items():
                    if where not in self._subscribers:
                        logger.info("hearing the drops of %s as well", where)
                        self._start(where, connect)  # it subscribes, retrying
                for where in self._subscribers.keys() - listed.keys():
                    logger.info("no longer hearing the drops of %s: it left", where)
                    thread, stop = self._subscribers.pop(where)
                    stop.set()
                    self._retired.append(thread)

    @property
    def servers(self) -> list[str]:
        """The servers heard now, by ``where``."""
        with self._lock:
            return sorted(self._subscribers)

    def _subscribe(self, where: str, connect: Callable[[], Any]) -> _Subscription:
        """A new client's server raising the notifications, subscribed to them."""
        client = connect()
        try:
            return _Subscription(where, client, self._channels)
        except BaseException:
            client.close()
            raise

    def _listen(
        self,
        where: str,
        connect: Callable[[], Any],
        stop: threading.Event,
        first: Future[None] | None,
    ) -> None:
        refusals = _refusals()
        subscription: _Subscription | None = None
        pause, warned = RETRY_S, False
        while not stop.is_set():
            if subscription is None:
                try:
                    subscription = self._subscribe(where, connect)
                    pause, warned = RETRY_S, False
                    self._tell_start(first, None)
                except refusals as exc:
                    if self._tell_start(first, exc):
                        return  # the start fails, and stops the others
                    # The server answers, but no (restarted without the
                    # setting, an ACL changed): said once, not raised.
                    if not warned:
                        logger.warning("cannot hear the drops of %s: %s; trying again", where, exc)
                        warned = True
                except Exception as exc:
                    if self._tell_start(first, None):  # the start goes on without it
                        logger.warning(
                            "cannot reach %s to hear its drops (%s); they are heard once "
                            "it answers",
                            where,
                            exc,
                        )
                    else:
                        logger.debug("subscribing to %s: %s", where, exc)
                first = None  # later attempts are this thread's own
                if subscription is None:
                    stop.wait(pause)
                    pause = min(pause * 2, MAX_RETRY_S)
                    continue
            try:
                self._relay(subscription.pubsub)
            except Exception as exc:
                logger.info("lost the drop notifications of %s (%s); reconnecting", where, exc)
                subscription.close()
                subscription = None
        if subscription is not None:
            subscription.close()

    def _relay(self, pubsub: Any) -> None:
        """Wait for the next notification, then report it with those queued behind it."""
        dropped: dict[str, list[bytes]] = {event: [] for event in EVENTS}
        gathered = 0
        message = pubsub.get_message(timeout=POLL_S)
        while message is not None:
            name, event = message.get("data"), _event(message.get("channel"))
            if isinstance(name, bytes) and event in dropped:
                dropped[event].append(name)
                gathered += 1
                if gathered == REPORT_BATCH:
                    break
            message = pubsub.get_message(timeout=0)
        for event, names in dropped.items():
            if names:
                self._report(event, names)

    def close(self) -> None:
        """Stop every subscriber and close its connection."""
        with self._lock:
            self._closed.set()
            threads = self._retired + [thread for thread, _ in self._subscribers.values()]
            for _, stop in self._subscribers.values():
                stop.set()
        if self._relister is not None:
            threads.append(self._relister)
        for thread in threads:
            thread.join(timeout=POLL_S * 4)


def _refusals() -> tuple[type[BaseException], ...]:
    """What a server that answers but will not let the tier hear raises:
    the notifications refused, a command or channel denied, bad credentials."""
    from redis.exceptions import AuthenticationError, AuthorizationError, ResponseError

    return (NotificationsRefused, ResponseError, AuthenticationError, AuthorizationError)


def _event(channel: Any) -> str:
    """The event a ``__keyevent@<db>__:<event>`` channel carries."""
    if isinstance(channel, bytes):
        channel = channel.decode("ascii", "replace")
    return str(channel).rpartition(":")[2]
