"""A guard for kombu's Redis transport: a worker must outlive a Redis restart.

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
"""

from __future__ import annotations

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
