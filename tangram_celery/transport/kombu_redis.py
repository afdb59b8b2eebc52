"""Two patches to kombu's Redis transport: a guard (a worker must outlive a Redis restart) and
one client per channel for what kombu publishes.

When Redis goes away while a worker holds unacknowledged messages (with late acks: every task
running at that moment), Celery closes the broker connection and kombu's channel tries to put
those messages back through a new connection pool. By then the transport's connection object
is gone, and building the pool's parameters fails with `AttributeError: 'NoneType' object has
no attribute 'hostname'` (kombu 5.7.0, `Channel._connparams`). That error is not a connection
error, so Celery's "ignore connection errors while closing" lets it through and the worker
stops with "Unrecoverable error"; the supervisor starts a new one, and every sandbox of the old
one is gone (each trajectory on that node comes back `sandbox_reset`).

The guard turns that case into the connection error it is, which Celery ignores while it
closes and then reconnects as it does for any broker loss. The messages stay in Redis's unacked
set (kombu restores them after the visibility timeout), and Tangram does not depend on them: an
action not claimed in time is sent again by the scheduler, and a claim is exactly once, so a
late copy never runs twice. Found by `benchmarks/soak.py` (a Redis SIGKILL took the CPU worker
down); `tests/integration/test_end_to_end.py::test_redis_killed_and_restarted_loses_nothing`
checks that no worker restarts.

The second (`reuse_channel_client`): kombu 5.7 builds a new `redis.Redis` for every command it
sends outside its polling connection (`Channel.conn_or_acquire`): every Celery message the
scheduler sends, every task event a worker publishes for Flower. Building one fills a table of
about 170 reply callbacks in Python (about 0.17 ms here), and the object is thrown away after
one command. A `redis.Redis` takes a connection from its pool per command and is safe to share
between threads, so each channel now keeps one and builds another only when kombu replaced the
channel's pool (after a lost connection).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from kombu.transport import redis as kombu_redis

_GUARDED = "_tangram_guarded"


def guard_connparams() -> None:
    """Make `Channel._connparams` raise a connection error once its connection is gone
    (idempotent)."""
    channel = kombu_redis.Channel
    original = channel._connparams
    if getattr(original, _GUARDED, False):
        return

    def _connparams(self: Any, asynchronous: bool = False) -> Any:
        transport = getattr(self, "connection", None)
        if transport is None or getattr(transport, "client", None) is None:
            raise redis.exceptions.ConnectionError("the broker connection is already closed")
        return original(self, asynchronous=asynchronous)

    setattr(_connparams, _GUARDED, True)
    setattr(channel, "_connparams", _connparams)  # noqa: B010 - patching a class method


_CLIENT = "_tangram_client"


def reuse_channel_client() -> None:
    """Make `Channel.conn_or_acquire` hand out one client per channel and pool (idempotent)."""
    channel = kombu_redis.Channel
    if getattr(channel.conn_or_acquire, _GUARDED, False):
        return

    @contextmanager
    def conn_or_acquire(self: Any, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        pool = self.pool  # kombu drops its pools on a lost connection: follow it
        cached = self.__dict__.get(_CLIENT)
        if cached is None or cached.connection_pool is not pool:
            cached = self._create_client()
            self.__dict__[_CLIENT] = cached
        yield cached

    setattr(conn_or_acquire, _GUARDED, True)
    setattr(channel, "conn_or_acquire", conn_or_acquire)  # noqa: B010 - patching a class method
