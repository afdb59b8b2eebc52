"""The client side of the store on `redis.asyncio`: it sends the calls of `client_ops` for
`AsyncTangramClient`, as `client_side.py` does on a blocking connection.

Commands share a small pool (a full pool makes callers wait their turn, it does not fail
them); the asyncio client's result listener holds a connection of its own in BLPOP (`listen`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis
import redis.asyncio as aredis
from redis.exceptions import NoScriptError

import tangram_celery.store.client_ops as ops
from tangram_celery.common import tenants
from tangram_celery.store.base import tenant_of_url
from tangram_celery.store.calls import RETRYABLE, Backoff, Call, not_loaded
from tangram_celery.store.scripts import SUBMIT

T = TypeVar("T")


class AsyncStore:
    """The client side of the store for asyncio code (one per client), for `tenant` (default:
    the URL's Redis user's, `base.tenant_of_url`)."""

    def __init__(
        self,
        url: str,
        *,
        max_connections: int = 32,
        retry_budget_s: float = 120.0,
        tenant: str | None = None,
    ) -> None:
        self.url = url
        self.tenant = tenants.valid_name(tenant) if tenant is not None else tenant_of_url(url)
        self.retry_budget_s = retry_budget_s
        pool = aredis.BlockingConnectionPool.from_url(
            url,
            decode_responses=True,
            max_connections=max_connections,
            timeout=None,
            socket_timeout=30.0,
            health_check_interval=30,
        )
        self.r = aredis.Redis(connection_pool=pool)
        self._listen = aredis.Redis.from_url(
            url, decode_responses=True, single_connection_client=True, socket_timeout=None
        )
        self._memory = ops.MemoryCheck()

    async def retrying(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """`fn()`, retried with backoff while Redis is unreachable (idempotent operations only);
        BrokerError when `retry_budget_s` is spent."""
        backoff = Backoff(what, self.url, self.retry_budget_s)
        while True:
            try:
                return await fn()
            except RETRYABLE as e:
                await asyncio.sleep(backoff.after(e))

    async def run(self, call: Call[T]) -> T:
        """Send `call` (retried while Redis is unreachable) and read its reply."""
        return call.parse(await self.retrying(call.what, lambda: self._send(self.r, call)))

    async def once(self, call: Call[T], *, listener: bool = False) -> T:
        """Send `call` once (on the result listener's own connection if `listener`) and read
        its reply."""
        return call.parse(await self._send(self._listen if listener else self.r, call))

    async def _send(self, conn: aredis.Redis, call: Call[Any]) -> Any:
        send = getattr(conn, call.method)
        try:
            return await send(*call.args, **call.kwargs)
        except NoScriptError:
            if call.script is None:
                raise
            await self.load_script(call.script, conn)  # a restarted Redis: load it, send once more
            return await send(*call.args, **call.kwargs)

    async def load_script(self, script: str, conn: aredis.Redis | None = None) -> None:
        """SCRIPT LOAD `script`; ScriptNotLoaded (retried) for a user that may not (a tenant's)."""
        try:
            await (conn or self.r).script_load(script)
        except redis.exceptions.NoPermissionError as e:
            raise not_loaded(script, e) from None

    async def send_all(self, calls: Sequence[Call[Any]], raise_on_error: bool = True) -> list[Any]:
        """The raw replies to `calls`, in one round trip (errors as values unless
        `raise_on_error`); a single call without a pipeline. Not retried."""
        if len(calls) == 1 and not raise_on_error:
            try:
                return [await getattr(self.r, calls[0].method)(*calls[0].args, **calls[0].kwargs)]
            except redis.ResponseError as e:  # a refusal is a value, as in a pipeline
                return [e]
        pipe = self.r.pipeline(transaction=False)
        for call in calls:
            getattr(pipe, call.method)(*call.args, **call.kwargs)
        return list(await pipe.execute(raise_on_error=raise_on_error))

    async def run_all(self, what: str, calls: Sequence[Call[T]], retry: bool = True) -> list[T]:
        """`calls` in one round trip (retried while Redis is unreachable unless not `retry`),
        each reply read."""
        replies = await (self.retrying(what, lambda: self.send_all(calls)) if retry else self.send_all(calls))
        return [call.parse(rep) for call, rep in zip(calls, replies, strict=True)]

    async def submit(
        self,
        items: Sequence[ops.Item],
        max_queued: int,
        *,
        ttl_s: float,
        admit_memory_fraction: float,
        notify: str,
    ) -> list[str]:
        """`Store.submit` for asyncio: the results wake the notification list `notify`."""
        await self._admit_memory(admit_memory_fraction, len(items))

        async def send() -> list[Any]:
            batch = ops.SubmitBatch(items, max_queued, ops.ttl_arg(ttl_s), notify, self.tenant)
            while not batch.take(await self.send_all(batch.pending(), raise_on_error=False)):
                await self.load_script(SUBMIT)
            return batch.replies

        return ops.check_submitted(items, await self.retrying("submit", send), max_queued)

    async def _admit_memory(self, fraction: float, n: int) -> None:
        now = time.monotonic()
        if self._memory.due(now):
            self._memory.saw(await self.memory_use(), now)
        self._memory.admit(fraction, n)

    async def memory_use(self) -> tuple[int, int]:
        """`StoreBase.memory_use`: as the scheduler published it, else INFO (default tenant)."""
        got = await self.run(ops.published_memory())
        if got is not None:
            return got
        if self.tenant != tenants.DEFAULT:
            return 0, 0
        try:
            return await self.run(ops.memory_use())
        except redis.exceptions.NoPermissionError:
            return 0, 0

    def qualified(self, local_id: str) -> str:
        return tenants.qualify(self.tenant, local_id)

    async def close(self) -> None:
        await self._listen.aclose()
        await self.r.aclose()
        await self.r.connection_pool.disconnect()  # a pool passed in is not closed by aclose
