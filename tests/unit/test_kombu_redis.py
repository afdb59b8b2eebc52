"""The patches to kombu's Redis transport (tangram_celery.transport.kombu_redis)."""

from __future__ import annotations

from typing import Any

import redis
from kombu.transport import redis as kombu_redis

from tangram_celery.transport.kombu_redis import reuse_channel_client


class _Channel:
    """What `conn_or_acquire` uses of a kombu Redis channel: its pool and `_create_client`."""

    def __init__(self) -> None:
        self.pool = redis.ConnectionPool(host="127.0.0.1", port=1)
        self.created = 0

    def _create_client(self) -> Any:
        self.created += 1
        return redis.Redis(connection_pool=self.pool)


def test_a_channel_publishes_through_one_client_until_its_pool_is_replaced() -> None:
    """Given the patch, when a channel acquires a client three times, then it builds one; when
    kombu replaces the channel's pool (a lost connection), the next acquire builds one on the
    new pool; a client passed in is handed back as it is."""
    reuse_channel_client()
    reuse_channel_client()  # idempotent
    acquire = kombu_redis.Channel.conn_or_acquire
    ch = _Channel()
    seen = []
    for _ in range(3):
        with acquire(ch) as client:
            seen.append(client)
    assert ch.created == 1 and seen[0] is seen[1] is seen[2]
    ch.pool = redis.ConnectionPool(host="127.0.0.1", port=2)
    with acquire(ch) as client:
        assert ch.created == 2 and client.connection_pool is ch.pool
    mine = object()
    with acquire(ch, mine) as client:
        assert client is mine and ch.created == 2
