"""`tangram tenant` against a real Redis 7 with ACL users (issue 37): the printed client URL
authenticates, submits into its own intake and reaches nothing of another tenant's; a rotated
password is refused at once; remove refuses while work waits, then the user is gone."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from tangram_celery.cli import main

pytestmark = pytest.mark.integration


def _tangram(capsys: pytest.CaptureFixture[str], url: str, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["tenant", *argv, "--broker-url", url])
    out, err = capsys.readouterr()
    return rc, out, err


def _add(capsys: pytest.CaptureFixture[str], url: str, name: str, *flags: str) -> dict[str, Any]:
    rc, out, err = _tangram(capsys, url, "add", name, "--json", *flags)
    assert rc == 0, err
    data: dict[str, Any] = json.loads(out)
    return data


def _names() -> tuple[str, str]:
    tag = secrets.token_hex(3)  # ACL users outlive the flush between tests: names of their own
    return f"a{tag}", f"b{tag}"


def test_add_gives_a_url_that_reaches_only_its_own_work(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A's URL authenticates and writes A's intake; it cannot read B's actions, write B's
    intake or its own limits, read the registry, or run admin commands. Tokens are stored
    hashed, and `list` shows no secret."""
    a, b = _names()
    tenant_a = _add(capsys, redis_url, a, "--max-queued", "7", "--api-share", "calc=0.5")
    tenant_b = _add(capsys, redis_url, b)
    assert tenant_a["client_url"].startswith(f"redis://tenant-{a}:")
    assert tenant_a["quotas"]["max_queued"] == 7
    rc, _, err = _tangram(capsys, redis_url, "add", a)
    assert rc == 2 and "exists" in err

    admin = redis.Redis.from_url(redis_url, decode_responses=True)
    admin.hset(f"tangram:t:{b}:a:x1", mapping={"payload": "b's hidden test", "state": "queued"})
    ra = redis.Redis.from_url(tenant_a["client_url"], decode_responses=True)
    assert ra.ping()
    ra.xadd(f"tangram:t:{a}:intake", {"id": "x1"})  # its own intake: the submit's write
    assert admin.xlen(f"tangram:t:{a}:intake") == 1
    assert ra.hgetall("tangram:config") == {}  # shared, read-only
    for attempt in (
        lambda: ra.hgetall(f"tangram:t:{b}:a:x1"),
        lambda: ra.xadd(f"tangram:t:{b}:intake", {"x": "1"}),
        lambda: ra.hgetall("tangram:tenants"),
        lambda: ra.hgetall("tangram:running"),
        lambda: ra.config_get("dir"),
        lambda: ra.keys("*"),
        lambda: ra.hset(f"tangram:t:{a}:limits", "max_queued", "0"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    record = json.loads(admin.hget("tangram:tenants", b) or "{}")
    assert record["token_sha256"] and tenant_b["http_token"] not in json.dumps(record)

    rc, out, _ = _tangram(capsys, redis_url, "list", "--json")
    listed = {t["name"]: t for t in json.loads(out)}
    assert (
        listed[a]["token_set"]
        and listed[a]["redis_user"]
        and listed[a]["quotas"]["api_share"] == {"calc": 0.5}
    )
    assert tenant_a["http_token"] not in out and tenant_a["client_url"].split("@")[0] not in out
    for name in (a, b):
        assert _tangram(capsys, redis_url, "remove", name, "--force")[0] == 0


def test_rotate_refuses_the_old_password_at_once(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """An open connection with the old password is closed; a new one is refused; the new URL
    works. --token-only keeps the password and changes the stored digest."""
    a, _ = _names()
    old = _add(capsys, redis_url, a)
    held = redis.Redis.from_url(old["client_url"], single_connection_client=True)
    assert held.ping()
    rc, out, _ = _tangram(capsys, redis_url, "rotate", a, "--password-only", "--json")
    new = json.loads(out)
    assert rc == 0 and "http_token" not in new and new["client_url"] != old["client_url"]
    with pytest.raises(redis.exceptions.ConnectionError):  # killed (a reconnect is refused)
        held.ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(old["client_url"]).ping()
    assert redis.Redis.from_url(new["client_url"]).ping()

    admin = redis.Redis.from_url(redis_url, decode_responses=True)
    digest = json.loads(admin.hget("tangram:tenants", a) or "{}")["token_sha256"]
    rc, out, _ = _tangram(capsys, redis_url, "rotate", a, "--token-only", "--json")
    rotated = json.loads(out)
    assert rc == 0 and "client_url" not in rotated and rotated["http_token"] != old["http_token"]
    assert json.loads(admin.hget("tangram:tenants", a) or "{}")["token_sha256"] != digest
    assert redis.Redis.from_url(new["client_url"]).ping()
    assert _tangram(capsys, redis_url, "remove", a)[0] == 0


def test_remove_waits_for_work_unless_forced(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """With an action in its intake, remove refuses (exit 2, saying why); --force deletes the
    user (its URL is refused) and the record."""
    a, _ = _names()
    tenant = _add(capsys, redis_url, a)
    redis.Redis.from_url(tenant["client_url"]).xadd(f"tangram:t:{a}:intake", {"id": "x1"})
    rc, _, err = _tangram(capsys, redis_url, "remove", a)
    assert rc == 2 and "intake" in err and "--force" in err
    rc, out, _ = _tangram(capsys, redis_url, "remove", a, "--force")
    assert rc == 0 and "deleted" in out and "removed" in out
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(tenant["client_url"]).ping()
    admin = redis.Redis.from_url(redis_url, decode_responses=True)
    assert admin.hget("tangram:tenants", a) is None
    assert f"tenant-{a}" not in admin.acl_users()
    rc, _, err = _tangram(capsys, redis_url, "remove", a)
    assert rc == 2 and "no tenant" in err


def test_an_external_redis_without_aclfile_gets_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`add` on a Redis with no aclfile (an external one) works and says the user is not
    saved across its restart; `remove` too."""
    import shutil
    import socket
    import subprocess

    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([binary, *args, "--requirepass", "pw", "--dir", str(tmp_path)])
    url = f"redis://:pw@127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if redis.Redis.from_url(url).ping():
                    break
            except redis.exceptions.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        rc, out, err = _tangram(capsys, url, "add", "ext")
        assert rc == 0 and "tenant ext added" in out and "no aclfile" in err
        assert "tenant-ext" in redis.Redis.from_url(url, decode_responses=True).acl_users()
        rc, out, err = _tangram(capsys, url, "remove", "ext")
        assert rc == 0 and "deleted" in out and "no aclfile" in err
    finally:
        proc.terminate()
        proc.wait(10)
