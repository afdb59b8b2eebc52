"""The embedded Redis keeps its data owner-only: the AOF holds every payload, the config the
password."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.fixtures.common import unavailable


def test_embedded_redis_files_are_owner_only(tmp_path: Path) -> None:
    """Given a data directory an older version left world-readable, when the embedded Redis
    starts and writes, then the directory is 0700 and its AOF, config and log are 0600."""
    from tangram_celery.transport.broker import EmbeddedRedis

    data = tmp_path / "redis"
    data.mkdir(mode=0o755)
    (data / "redis.log").write_text("old\n")
    os.chmod(data / "redis.log", 0o644)
    server = EmbeddedRedis(data)
    try:
        server.start()
    except Exception as e:  # pragma: no cover - no redis-server binary
        unavailable(f"redis-server cannot start: {e}")
    try:
        import redis

        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        client.close()
    finally:
        server.stop()
    assert stat.S_IMODE(os.stat(data).st_mode) == 0o700
    files = [p for p in data.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"redis.conf", "redis.log"} and any("aof" in p.name for p in files)
    for p in files:
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p
    for d in (p for p in data.rglob("*") if p.is_dir()):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d


def test_a_port_taken_between_the_check_and_the_start_is_replaced(tmp_path: Path) -> None:
    """Given the port of the last run's server (kept so that the URL stays the same), taken by
    another process after the check that it was free, when the new server starts, then it
    starts on another port and its URL says so, with the same password and data; a restart
    then keeps that new port. A port the caller gave is never replaced."""
    import socket

    import redis

    from tangram_celery.common.errors import BrokerError
    from tangram_celery.transport.broker import EmbeddedRedis

    data = tmp_path / "redis"
    first = EmbeddedRedis(data, keep_address=True)
    try:
        first.start()
    except Exception as e:  # pragma: no cover - no redis-server binary
        unavailable(f"redis-server cannot start: {e}")
    try:
        redis.Redis.from_url(first.url).set("k", "kept")
    finally:
        first.stop()
    second = EmbeddedRedis(data, keep_address=True)
    assert (second.port, second.password) == (first.port, first.password)  # free at the check
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", first.port))
    squatter.listen(1)
    try:
        second.start()
        try:
            assert second.port != first.port and second.password == first.password
            assert redis.Redis.from_url(second.url).get("k") == b"kept"
            moved = second.port
            second.restart()
            assert second.port == moved
        finally:
            second.stop()
        given = EmbeddedRedis(tmp_path / "given", port=first.port)
        with pytest.raises(BrokerError, match="taken"):
            given.start()
    finally:
        squatter.close()
