"""In-memory twins of Tangram's external systems, for unit tests of code that talks to them.

    store = memory_store()      # a `Store` on fakeredis, Lua scripts included
    app = memory_app()          # a Celery app on kombu's in-process `memory://` transport
    svc = SchedulerService(cfg, "memory://", store=store, app=app, clock=clock)
    sent = sent_messages(app, "tangram.cpu.n0")

The store runs the very scripts of `tangram_celery.store` on fakeredis (with `lupa`), so the
exactly-once protocol is exercised as it is against Redis; what fakeredis cannot do (INFO, for
the admission memory check) reports no memory ceiling. The real systems are still tested for
real by the integration tests. Needs the `test` extra: `pip install 'tangram[test]'`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from celery import Celery

from tangram_celery.common import tenants
from tangram_celery.common.wire import ActionMeta, AllocationWire, DispatchRecord, TaskOrder
from tangram_celery.store import RUNNING, Store, akey
from tangram_celery.transport.app import make_app


def _fakeredis() -> Any:
    try:
        import fakeredis
        import lupa  # noqa: F401  (fakeredis runs Lua scripts with it)
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"tangram_celery.testing needs fakeredis with Lua support ({e}); "
            "install it with: pip install 'fakeredis[lua]' (or the 'test' extra of tangram)"
        ) from None
    return fakeredis


class MemoryStore(Store):
    """A `Store` on an in-memory Redis (fakeredis). `server` can be shared by several stores,
    as several processes share one Redis."""

    def __init__(self, server: Any = None, tenant: str | None = None) -> None:
        fakeredis = _fakeredis()
        self.server = server or fakeredis.FakeServer()
        client = fakeredis.FakeRedis(server=self.server, decode_responses=True)
        # Lua's redis.sha1hex (the submit script's payload digest) is missing from fakeredis's
        # Lua runtime: provide it, with the same value Redis computes.
        client.eval("return 1", 0)
        lua = self.server._lua_runtime
        lua.globals().redis.sha1hex = lambda b: hashlib.sha1(b).hexdigest().encode()
        super().__init__("memory://", client=client, tenant=tenant)

    def memory_use(self) -> tuple[int, int]:
        return 0, 0  # fakeredis has no INFO: no memory ceiling

    def redis_memory(self) -> tuple[int, int]:
        return 0, 0


def memory_store(server: Any = None, tenant: str | None = None) -> MemoryStore:
    """A fresh in-memory store (or one more connection to `server`), acting as `tenant`'s client
    (default: the default tenant)."""
    return MemoryStore(server, tenant)


def memory_app() -> Celery:
    """A Tangram Celery app on kombu's in-process transport (shared by every app of the process)."""
    return make_app("memory://")


def sent_messages(app: Celery, queue: str) -> list[tuple[str, list[Any]]]:
    """Take every message waiting in `queue`: (task name, args) each, oldest first."""
    out: list[tuple[str, list[Any]]] = []
    with app.connection_for_read() as conn:
        q = conn.SimpleQueue(queue)
        try:
            while True:
                try:
                    msg = q.get(block=False)
                except q.Empty:
                    break
                body = msg.decode() if not isinstance(msg.payload, list | tuple) else msg.payload
                args = body[0] if isinstance(body, list | tuple) else json.loads(body)[0]
                out.append((str(msg.headers.get("task")), list(args)))
                msg.ack()
        finally:
            q.close()
    return out


def dispatch(
    store: Store,
    action_id: str,
    attempt: int = 1,
    *,
    kind: str = "api",
    pool: str = "calc",
    unit_ids: tuple[int, ...] = (),
) -> TaskOrder:
    """Dispatch a submitted action by hand, as the scheduler's `DISPATCH` does (its hash's state
    and attempt, and its record in `tangram:running`, which a worker's claim checks); returns
    the worker's order. `action_id` is qualified (`tenants.qualify`) for a named tenant's."""
    raw = store.r.hget(akey(action_id), "meta")
    tenant = tenants.tenant_of(action_id)
    if raw is None:  # its record expired
        meta = ActionMeta(id=action_id, type="api", api=pool, submitted_s=0.0)
    else:  # as the scheduler keeps it (`Intake.own`): a named tenant's ids qualified
        meta = ActionMeta.model_validate_json(raw)
        if tenant != tenants.DEFAULT:
            tid = tenants.qualify(tenant, meta.trajectory_id)
            meta = meta.model_copy(update={"id": action_id, "trajectory_id": tid, "job_id": tenant})
    units = max(1, len(unit_ids))
    alloc = AllocationWire(action_id=action_id, kind=kind, pool=pool, units=units, unit_ids=unit_ids)
    record = DispatchRecord(alloc=alloc, meta=meta, attempt=attempt)
    store.r.hset(RUNNING, action_id, record.model_dump_json(exclude_none=True))
    store.r.hset(akey(action_id), mapping={"state": "dispatched", "attempt": str(attempt)})
    return TaskOrder(**dict(alloc), attempt=attempt)


def tenant_url(admin_url: str, name: str) -> str:
    """A new tenant's client URL, as `tangram tenant add NAME` makes it (its own Redis user)."""
    from tangram_celery.tenant_cli import add_tenant

    url = add_tenant(admin_url, name).client_url
    assert url is not None
    return url
