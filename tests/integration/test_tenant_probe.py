"""Two tenants on one live deployment, the second trying everything against the first (issue 37).

The victim `acme` runs a trajectory `t1` that writes a file and then runs a hidden test. While
its actions wait, the attacker `bee`, holding only its own credentials, tries to reach them:
through the Python client (same trajectory and action ids, cancel, close), through raw Redis
with its own user (other keys, Celery's queues and channels, admin commands, scripts with keys
undeclared or declared, its own action's notify list pointed at the victim's), and over HTTP
with its own token. Nothing may work, and afterwards the victim's results, hidden test verdict
and files are intact.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.integration.http_support import bearer_call

pytestmark = pytest.mark.integration

SECRET = "acme-file-7f3a"
HIDDEN = "HIDDEN-ASSERT-91c2"


def _add(admin_url: str, name: str) -> tuple[str, str]:
    """(client URL, HTTP token) of a new tenant, as `tangram tenant add` makes them."""
    from tangram_celery.tenant_cli import add_tenant

    made = add_tenant(admin_url, name)
    assert made.client_url and made.http_token
    return made.client_url, made.http_token


def _refused(r: Any, *command: Any) -> str:
    """The error Redis answers `command` with (the test fails if it runs)."""
    import redis

    try:
        reply = r.execute_command(*command)
    except redis.ResponseError as e:
        return str(e)
    raise AssertionError(f"{command[:3]!r} ran for the attacker: {reply!r}")


def _raw_redis_probe(bee_url: str, victim_ids: list[str]) -> list[str]:
    """Every raw command the attacker's own Redis user tries; the refusals, one per command."""
    import redis

    r = redis.Redis.from_url(bee_url, decode_responses=True)
    a_key = f"tangram:t:acme:a:{victim_ids[0]}"
    undeclared = f"return redis.call('HGETALL', '{a_key}')"
    attempts: list[tuple[Any, ...]] = [
        ("KEYS", "*"),
        ("SCAN", 0),
        ("HGETALL", a_key),
        ("HGET", a_key, "payload"),
        ("HSET", a_key, "state", "done"),
        ("DEL", a_key),
        ("RPUSH", f"tangram:t:acme:n:{victim_ids[0]}", '{"status": "ok"}'),
        ("RPUSH", "tangram:t:acme:nq:any", '{"status": "ok"}'),
        ("XADD", "tangram:t:acme:intake", "*", "control", "close", "trajectory_id", "t1"),
        ("XADD", "tangram:intake", "*", "control", "close", "trajectory_id", "acme/t1"),
        ("XADD", "tangram:events", "*", "id", f"acme/{victim_ids[0]}", "event", "{}"),
        ("HGETALL", "tangram:running"),
        ("HGETALL", "tangram:traj"),
        ("HGETALL", "tangram:tenants"),
        ("HSET", "tangram:t:bee:limits", "max_queued", "0"),
        ("HSET", "tangram:config", "x", "y"),
        ("LPUSH", "tangram.cpu.n0", "{}"),
        ("LRANGE", "tangram.cpu.n0", 0, -1),
        ("SMEMBERS", "_kombu.binding.tangram"),
        ("PUBLISH", "/0.celery.pidbox", "{}"),
        ("SUBSCRIBE", "/0.celeryev/task"),
        ("CONFIG", "GET", "dir"),
        ("CONFIG", "SET", "dir", "/tmp"),
        ("SAVE",),
        ("BGREWRITEAOF",),
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("SHUTDOWN", "NOSAVE"),
        ("ACL", "LIST"),
        ("ACL", "SETUSER", "tenant-bee", "~*", "+@all"),
        ("CLIENT", "LIST"),
        ("CLIENT", "KILL", "USER", "tenant-acme"),
        ("MONITOR",),
        ("DEBUG", "SLEEP", "0"),
        ("SCRIPT", "FLUSH"),
        ("FUNCTION", "LIST"),
        ("MODULE", "LIST"),
        ("INFO", "keyspace"),
        ("EVAL", undeclared, 0),
        ("EVAL", "return redis.call('HGETALL', KEYS[1])", 1, a_key),
        ("EVAL", "return redis.call('FLUSHALL')", 0),
        ("EVAL", "while true do end", 0),  # would make Redis answer BUSY to everyone
        ("SCRIPT", "LOAD", "while true do end"),
        ("FCALL", "f", 0),
    ]
    try:
        return [_refused(r, *cmd) for cmd in attempts]
    finally:
        r.close()


def _crafted_submit(bee: Any, action: Any, *, replace: tuple[str, str] = ("", ""), notify: str = "") -> None:
    """Submit `action` for `bee` past its client's checks: its stored metadata and payload with
    `replace` applied, and `notify` as its notification list, through the submit script."""
    import time as _time

    from tangram_celery.store.client_ops import SubmitBatch

    batch = bee.core.batch([action], _time.time())
    old, new = replace
    items = [(i, meta.replace(old, new), payload.replace(old, new)) for i, meta, payload in batch.items]
    sub = SubmitBatch(items, 0, "0", notify=notify, tenant=bee.tenant)
    replies = bee.store.send_all(sub.pending(), raise_on_error=False)
    assert not any(isinstance(x, Exception) for x in replies), replies


@pytest.mark.deploy(http={"token": "operator-s3cret"})
def test_a_tenant_reaches_nothing_of_another(http_deployment: Any) -> None:
    import redis

    from tangram_celery import CodeAction, TangramClient
    from tangram_celery.common.actions import ActionStatus, TestCase
    from tangram_celery.common.errors import ResultTimeout

    dep = http_deployment
    acme_url, acme_token = _add(dep.url, "acme")
    bee_url, bee_token = _add(dep.url, "bee")
    acme, bee = TangramClient(acme_url), TangramClient(bee_url)
    try:
        # the victim: a file, then (queued behind it) a hidden test, then a read of the file
        write = CodeAction(
            id="w1", trajectory_id="t1", language="bash", code=f"echo {SECRET} > secret.txt; sleep 4"
        )
        hidden = CodeAction(
            id="h1",
            trajectory_id="t1",
            code="def f(x):\n    return 2 * x\n",
            test_cases=[TestCase(name="t_hidden", assert_code=f"assert f(2) == 4, '{HIDDEN}'")],
        )
        h_write, h_hidden = acme.submit_many([write, hidden])
        time.sleep(0.5)  # both wait (the first runs, the second is queued behind it)

        # the attacker through its Python client: the same ids are its own, never the victim's
        assert bee.cancel("h1") is False  # no such action of bee's
        assert bee.store.action_state("w1") is None
        with pytest.raises(ResultTimeout):
            bee.handle("w1").result(timeout=1)
        # its own credential told to act as the victim: Redis refuses every key of acme's
        posing = TangramClient(bee_url, tenant="acme")
        try:
            with pytest.raises(redis.exceptions.NoPermissionError):
                posing.handle("w1").result(timeout=1)
            with pytest.raises(redis.exceptions.NoPermissionError):
                posing.cancel("h1")
        finally:
            posing.close()
        bee.close_trajectory("t1")  # bee's t1: acme's is untouched
        peek = bee.submit(
            CodeAction(id="w1", trajectory_id="t1", language="bash", code="cat secret.txt || echo absent")
        ).result(timeout=60)
        assert peek.stdout.strip() == "absent", peek

        # past its client's checks: a trajectory id naming the victim's, and its result's
        # notification pointed at a list of the victim's
        if bee.core.wants_view(0.0):
            bee.core.saw_view(bee.store.pool_view(), 0.0)
        _crafted_submit(
            bee,
            CodeAction(id="x1", trajectory_id="zz9", language="bash", code="cat secret.txt || echo absent"),
            replace=("zz9", "acme/t1"),
        )
        _crafted_submit(
            bee, CodeAction(id="x2", language="bash", code="echo forged"), notify="tangram:t:acme:nq:v"
        )
        x1 = bee.handle("x1").result(timeout=60)
        assert SECRET not in x1.stdout + x1.stderr, x1
        bee.handle("x2").result(timeout=60)
        admin = redis.Redis.from_url(dep.url, decode_responses=True)
        assert admin.llen("tangram:t:acme:nq:v") == 0
        admin.close()

        # the attacker over raw Redis, with its own credential
        refusals = _raw_redis_probe(bee_url, ["w1", "h1"])
        said = ("noperm", "no permissions", "not allowed", "can't run", "can't access")  # ACL's, DEBUG's
        other = [e for e in refusals if not any(w in e.lower() for w in said)]
        assert not other, other

        # over HTTP with its own token: the victim's ids are 404 (never 403)
        http_url = dep.http_url
        for method, path in [
            ("GET", "/tangram/v1/actions/h1"),
            ("DELETE", "/tangram/v1/actions/h1"),
        ]:
            status, body = bearer_call(http_url, method, path, bee_token)
            assert status == 404, (method, path, status, body)
            assert HIDDEN not in json.dumps(body)
        status, _ = bearer_call(http_url, "POST", "/tangram/v1/trajectories/t1/close", bee_token)
        assert status in (202, 404)
        status, _ = bearer_call(http_url, "GET", "/tangram/v1/actions/h1", "not-a-token")
        assert status == 401

        # Redis's script cache emptied (a restart does it): the scheduler loads the clients'
        # scripts again, which the tenants may run but not load themselves
        admin = redis.Redis.from_url(dep.url, decode_responses=True)
        admin.script_flush()
        admin.close()
        again = bee.submit(CodeAction(trajectory_id="t9", code="print(3)")).result(timeout=60)
        assert again.stdout == "3\n", again

        # the victim: everything intact
        assert h_write.result(timeout=60).status is ActionStatus.OK
        verdict = h_hidden.result(timeout=60)
        assert verdict.status is ActionStatus.OK, verdict
        after = acme.submit(CodeAction(trajectory_id="t1", language="bash", code="cat secret.txt")).result(
            timeout=60
        )
        assert after.stdout.strip() == SECRET, after
        status, body = bearer_call(http_url, "GET", "/tangram/v1/actions/h1", acme_token)
        assert status == 200 and body["status"] == "ok", body
    finally:
        acme.close()
        bee.close()
