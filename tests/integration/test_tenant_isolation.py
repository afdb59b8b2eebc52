"""Tenant namespacing on a live deployment (issue 37): two tenants using the same trajectory and
action ids each get their own work, their own files and their own results back; neither can
cancel or close the other's work by id; a notification list of another tenant named in an
action's hash is never pushed onto.

Real Redis (the embedded broker with its ACL users), the real scheduler and workers; the
tenants are made as `tangram tenant add` makes them (`tenant_cli.Admin`), so every call here
goes through the tenant's own Redis user.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tangram_celery.common.actions import ActionStatus, CodeAction
from tangram_celery.testing import tenant_url

pytestmark = pytest.mark.integration


def _wait_read(admin_url: str, names: list[str], timeout_s: float = 10.0) -> None:
    """Until the scheduler reads the tenants' intakes (it reads the registry every second)."""
    import redis

    from tangram_celery.store.keys import GROUP, intake_key

    r = redis.Redis.from_url(admin_url, decode_responses=True)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                if all(any(g["name"] == GROUP for g in r.xinfo_groups(intake_key(n))) for n in names):
                    return
            except redis.ResponseError:
                pass
            time.sleep(0.1)
    finally:
        r.close()
    raise AssertionError(f"the scheduler never read the intakes of {names}")


def test_two_tenants_with_the_same_ids_keep_their_own_work(deployment: Any) -> None:
    """Given tenants a and b, when each runs action "x1" in trajectory "t1" writing a file of
    its own, then each reads back its own file and result under its own ids, and a file that
    only a wrote is absent in b's "t1"."""
    from tangram_celery import TangramClient

    urls = {n: tenant_url(deployment.url, n) for n in ("a", "b")}
    _wait_read(deployment.url, list(urls))
    a, b = TangramClient(urls["a"]), TangramClient(urls["b"])
    try:
        assert (a.tenant, b.tenant) == ("a", "b")
        write = {
            "a": CodeAction(id="x1", trajectory_id="t1", language="bash", code="echo A > f; touch only_a"),
            "b": CodeAction(id="x1", trajectory_id="t1", language="bash", code="echo B > f"),
        }
        handles = {"a": a.submit(write["a"]), "b": b.submit(write["b"])}
        for name, h in handles.items():
            res = h.result(timeout=60)
            assert res.status is ActionStatus.OK, (name, res)
            assert (res.action_id, res.trajectory_id) == ("x1", "t1")
        read = "cat f; ls only_a 2>/dev/null || echo absent"
        ra = a.submit(CodeAction(id="x2", trajectory_id="t1", language="bash", code=read)).result(timeout=60)
        rb = b.submit(CodeAction(id="x2", trajectory_id="t1", language="bash", code=read)).result(timeout=60)
        assert ra.stdout.split() == ["A", "only_a"]
        assert rb.stdout.split() == ["B", "absent"]
        assert (ra.action_id, rb.action_id) == ("x2", "x2")
    finally:
        a.close()
        b.close()


def test_a_tenant_cannot_cancel_or_close_another_tenants_work(deployment: Any) -> None:
    """Given tenant b's action "y1" queued behind its own action holding both cores, when
    tenant a cancels "y1" and closes "t1" (b's ids), then a's cancel finds nothing of its own,
    b's action runs, and b's trajectory keeps its file."""
    from tangram_celery import TangramClient

    urls = {n: tenant_url(deployment.url, n) for n in ("a", "b")}
    _wait_read(deployment.url, list(urls))
    a, b = TangramClient(urls["a"]), TangramClient(urls["b"])
    try:
        first = b.submit(CodeAction(id="w1", trajectory_id="t1", language="bash", code="echo kept > f"))
        assert first.result(timeout=60).status is ActionStatus.OK
        hog = b.submit(CodeAction(id="hog", trajectory_id="h", language="bash", code="sleep 2", cpus=2))
        queued = b.submit(CodeAction(id="y1", trajectory_id="t1", language="bash", code="cat f"))
        assert a.cancel("y1") is False  # a has no "y1"
        a.close_trajectory("t1")  # a's own "t1" (none): b's is untouched
        assert hog.result(timeout=60).status is ActionStatus.OK
        res = queued.result(timeout=60)
        assert res.status is ActionStatus.OK and res.stdout == "kept\n" and res.action_id == "y1"
        assert b.store.action_state("y1") == "done" and a.store.action_state("y1") is None
    finally:
        a.close()
        b.close()


def test_a_notify_list_of_another_tenant_named_in_a_hash_is_ignored(deployment: Any) -> None:
    """Given tenant a's asyncio client waiting on its notification list, when tenant b (with its
    own Redis user) makes its action's hash name a's list, then the worker completes b's action
    onto b's own list: a's list never gets b's result, and b still gets it."""
    import redis

    from tangram_celery import TangramClient
    from tangram_celery.client.aio import AsyncTangramClient
    from tangram_celery.store.keys import akey

    urls = {n: tenant_url(deployment.url, n) for n in ("a", "b")}
    _wait_read(deployment.url, list(urls))

    async def go() -> tuple[str, int]:
        async with AsyncTangramClient(urls["a"]) as a:
            listener = a.notify
            assert listener.startswith("tangram:t:a:nq:")
            b = TangramClient(urls["b"])
            rb = redis.Redis.from_url(urls["b"], decode_responses=True)
            try:
                hog = b.submit(
                    CodeAction(id="hog", trajectory_id="h", language="bash", code="sleep 1", cpus=2)
                )
                h = b.submit(CodeAction(id="z1", trajectory_id="t1", language="bash", code="echo b"))
                # b's own user may write its own keys: the hash now names a's list
                rb.hset(akey("b/z1"), "notify", listener)
                assert hog.result(timeout=60).status is ActionStatus.OK
                res = h.result(timeout=60)
            finally:
                rb.close()
                b.close()
            await asyncio.sleep(0.5)
            admin = redis.Redis.from_url(deployment.url)
            try:
                return res.stdout, int(admin.llen(listener))
            finally:
                admin.close()

    stdout, pushed = asyncio.run(go())
    assert stdout == "b\n" and pushed == 0
