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

from tangram_celery.store import Store
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

    def __init__(self, server: Any = None) -> None:
        fakeredis = _fakeredis()
        self.server = server or fakeredis.FakeServer()
        client = fakeredis.FakeRedis(server=self.server, decode_responses=True)
        # Lua's redis.sha1hex (the submit script's payload digest) is missing from fakeredis's
        # Lua runtime: provide it, with the same value Redis computes.
        client.eval("return 1", 0)
        lua = self.server._lua_runtime
        lua.globals().redis.sha1hex = lambda b: hashlib.sha1(b).hexdigest().encode()
        super().__init__("memory://", client=client)

    def memory_use(self) -> tuple[int, int]:
        return 0, 0  # fakeredis has no INFO: no memory ceiling


def memory_store(server: Any = None) -> MemoryStore:
    """A fresh in-memory store (or one more connection to `server`)."""
    return MemoryStore(server)


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
