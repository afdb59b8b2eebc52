"""Redis users per role and per tenant, against the real Redis 7 (issue 37, roles)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tangram_celery.common import tenants
from tangram_celery.store import keys
from tangram_celery.transport import acl
from tests.fixtures.common import wait_until

NOPERM = (redis.exceptions.NoPermissionError, redis.exceptions.ResponseError)


def _connect(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5)


@pytest.fixture
def admin(redis_url: str) -> Iterator[redis.Redis]:
    r = _connect(redis_url)
    yield r
    for user in r.acl_users():
        if user.startswith(tenants.REDIS_USER_PREFIX):
            r.acl_deluser(user)
    r.close()


def _tenant(admin: redis.Redis, redis_url: str, name: str) -> redis.Redis:
    """A tenant's user made the way `tangram tenant add` makes it, and a client of it."""
    admin.execute_command(
        "ACL", "SETUSER", *acl.setuser_args(tenants.redis_user(name), "pw-" + name, acl.tenant_rules(name))
    )
    host = redis_url.rsplit("@", 1)[1]
    return _connect(f"redis://{tenants.redis_user(name)}:pw-{name}@{host}")


def test_the_default_user_is_refused(redis_server: object, redis_url: str) -> None:
    """Given the embedded server, a client without a user (the old single-password URL, even
    with the admin's password) is refused, and so is AUTH as `default`."""
    port = redis_server.port  # type: ignore[attr-defined]
    password = redis_server.password  # type: ignore[attr-defined]
    with pytest.raises((redis.exceptions.AuthenticationError, redis.exceptions.ResponseError)):
        redis.Redis(host="127.0.0.1", port=port, password=password).ping()
    with pytest.raises((redis.exceptions.AuthenticationError, redis.exceptions.ResponseError)):
        redis.Redis(host="127.0.0.1", port=port, username="default", password=password).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=port, protocol=2).get("k")


def test_a_worker_cannot_flush_configure_or_read_the_registry(
    admin: redis.Redis, redis_role_urls: dict[str, str]
) -> None:
    """A worker's user runs no admin command and never sees the tenant registry."""
    admin.hset(tenants.REGISTRY, "acme", "{}")
    for role in acl.WORKER_ROLES:
        w = _connect(redis_role_urls[role])
        assert w.ping()
        with pytest.raises(NOPERM):
            w.flushall()
        with pytest.raises(NOPERM):
            w.config_get("dir")
        with pytest.raises(NOPERM):
            w.hgetall(tenants.REGISTRY)
        w.close()
    assert admin.hget(tenants.REGISTRY, "acme") == b"{}"


def test_config_set_dir_is_refused_for_every_role_but_admin(redis_role_urls: dict[str, str]) -> None:
    """No role but the operator's can point Redis's files elsewhere."""
    for role in acl.ROLES:
        r = _connect(redis_role_urls[role])
        if role == acl.ADMIN:
            assert r.config_get("dir")
        else:
            with pytest.raises(NOPERM):
                r.config_set("dir", "/tmp")
            with pytest.raises(NOPERM):
                r.execute_command("SHUTDOWN", "NOSAVE")
        r.close()


def test_a_tenant_reaches_only_its_own_work(admin: redis.Redis, redis_url: str) -> None:
    """A tenant's user reads and writes its own keys and reads the shared config; it cannot
    read another tenant's keys or the deployment's, push onto Celery queues, publish to
    remote control, or write its own limits."""
    acme, other = _tenant(admin, redis_url, "acme"), _tenant(admin, redis_url, "other")
    admin.hset(keys.CONFIG, "v", "1")
    admin.hset(keys.RUNNING, "x", "1")
    admin.hset(tenants.prefix("other") + "a:secret", "payload", "hidden")
    admin.hset(tenants.prefix("acme") + "limits", "max_queued", "5")
    acme.hset(tenants.prefix("acme") + "a:mine", "state", "queued")
    assert acme.hget(tenants.prefix("acme") + "a:mine", "state") == b"queued"
    assert acme.hget(keys.CONFIG, "v") == b"1"
    assert acme.hget(tenants.prefix("acme") + "limits", "max_queued") == b"5"
    refused = [
        lambda: acme.hgetall(tenants.prefix("other") + "a:secret"),
        lambda: acme.hset(tenants.prefix("other") + "a:secret", "payload", "forged"),
        lambda: acme.rpush(tenants.prefix("other") + "nq:c1", "forged"),
        lambda: acme.hgetall(keys.RUNNING),
        lambda: acme.hgetall(tenants.REGISTRY),
        lambda: acme.hset(tenants.prefix("acme") + "limits", "max_queued", "0"),
        lambda: acme.hset(keys.CONFIG, "v", "2"),
        lambda: acme.lpush("tangram.cpu.n0", "{}"),
        lambda: acme.publish(acl.pidbox_channel(), "{}"),
        lambda: acme.publish(acl.events_channel().rstrip("*") + "task.succeeded", "{}"),
        lambda: acme.hgetall(keys.akey("x")),  # the default tenant's work
        lambda: acme.flushall(),
        lambda: acme.config_set("dir", "/tmp"),
        lambda: acme.keys("*"),
    ]
    for i, call in enumerate(refused):
        with pytest.raises(NOPERM):
            call()
            pytest.fail(f"call {i} was allowed")
    assert admin.hget(tenants.prefix("other") + "a:secret", "payload") == b"hidden"
    assert admin.hget(tenants.prefix("acme") + "limits", "max_queued") == b"5"
    assert other.ping()
    acme.close()
    other.close()


def test_tenant_users_persist_across_restarts_and_role_users_are_rewritten(tmp_path: Path) -> None:
    """A tenant user saved with ACL SAVE (`tangram tenant`) is there after a restart with the
    same URLs (`keep_address`); the role users keep their passwords."""
    from tangram_celery.transport.broker import EmbeddedRedis

    first = EmbeddedRedis(tmp_path / "redis", keep_address=True).start()
    try:
        r = _connect(first.url)
        r.execute_command("ACL", "SETUSER", *acl.setuser_args("tenant-acme", "pw", acl.tenant_rules("acme")))
        r.execute_command("ACL", "SAVE")
        r.close()
    finally:
        first.stop()
    second = EmbeddedRedis(tmp_path / "redis", keep_address=True).start()
    try:
        assert second.role_urls() == first.role_urls()
        host = second.url.rsplit("@", 1)[1]
        t = _connect(f"redis://tenant-acme:pw@{host}")
        assert t.ping()
        t.close()
        for role, url in second.role_urls().items():
            assert _connect(url).acl_whoami() == role
    finally:
        second.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="runs as the current user when not started by root")
def test_the_server_runs_unprivileged_when_started_by_root(redis_server: object) -> None:
    """Started by root, redis-server runs as Debian's `redis` user and owns its data directory."""
    import pwd

    pid = redis_server.proc.pid  # type: ignore[attr-defined]
    uid = os.stat(f"/proc/{pid}").st_uid
    assert uid != 0 and pwd.getpwuid(uid).pw_name == "redis"
    assert os.stat(redis_server.data_dir / "users.acl").st_uid == uid  # type: ignore[attr-defined]


def test_every_component_of_a_deployment_connects_as_its_role(deployment: object, client: object) -> None:
    """Given `tangram up`, the scheduler and each worker connect with their own users, an
    action runs end to end, and Redis refused none of their commands (ACL LOG is empty)."""
    from tangram_celery import CodeAction

    r = _connect(deployment.url)  # type: ignore[attr-defined]
    result = client.submit(CodeAction(trajectory_id="t1", code="print(6 * 7)")).result(timeout=120)  # type: ignore[attr-defined]
    assert result.stdout.strip() == "42", result
    users = {c["user"] for c in r.client_list()}
    assert {"scheduler", "worker-cpu", "worker-api"} <= users, users
    assert "default" not in users
    assert r.execute_command("ACL", "LOG") == []
    urls = Path(deployment.cfg.state_dir) / "secrets"  # type: ignore[attr-defined]
    assert oct(os.stat(urls).st_mode & 0o777) == "0o700"
    assert {p.name for p in urls.iterdir()} == {f"{role}.url" for role in acl.ROLES}
    r.close()


def test_a_restart_replays_scripts_and_transactions_with_the_default_user_off(tmp_path: Path) -> None:
    """Redis 7.0 replays its AOF as the `default` user: a script's writes (logged as one
    MULTI/EXEC) and a transaction written by a role are there after a SIGKILL and a restart."""
    from tangram_celery.transport.broker import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "redis", keep_address=True).start()
    try:
        r = _connect(server.role_url("scheduler"))
        script = "redis.call('HSET', KEYS[1], 'a', 1); redis.call('XADD', KEYS[2], '*', 'id', 'x'); return 1"
        r.eval(script, 2, keys.akey("x"), keys.INTAKE)
        with r.pipeline(transaction=True) as p:
            p.hset(keys.akey("y"), "b", 2).hset(keys.akey("z"), "c", 3).execute()
        r.close()
        # in the AOF before the kill: with appendfsync everysec Redis may hold its last writes
        # back (up to 2 s) while an fsync is slow, and a SIGKILL then loses them; that loss is
        # everysec's, documented, and not what this test is about
        admin = _connect(server.url)
        wait_until(
            "the writes are in the AOF", lambda: admin.info("persistence")["aof_buffer_length"] == 0, 10.0
        )
        admin.close()
        server.kill()
        server.restart()
        admin = _connect(server.url)
        assert admin.hgetall(keys.akey("x")) == {b"a": b"1"} and admin.xlen(keys.INTAKE) == 1
        assert admin.hgetall(keys.akey("z")) == {b"c": b"3"}
        assert "NOPERM" not in (server.data_dir / "redis.log").read_text()
        admin.close()
    finally:
        server.stop()
