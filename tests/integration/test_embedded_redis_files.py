"""The embedded Redis keeps its data owner-only: the AOF holds every payload, the config the
password."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.fixtures.common import unavailable

pytestmark = pytest.mark.integration


def test_embedded_redis_files_are_owner_only(tmp_path: Path) -> None:
    """Given a data directory an older version left world-readable, when the embedded Redis
    starts and writes, then the directory is 0700 and its AOF, config and log are 0600."""
    from tangram_celery.broker import EmbeddedRedis

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
