"""AsyncTangramClient: the asyncio client, for processes with thousands of actions in flight.

    client = AsyncTangramClient.from_config("configs/local.yaml")
    result = await client.run(CodeAction(trajectory_id="t1", code="print(1)"))

One Redis connection waits for the results of every action this process submitted: each
action's hash names this client's notification list (`tangram:nq:<client id>`), the completion
script pushes the result onto it, and one listener task pops results and resolves the waiting
futures. The thread-per-waiter BLPOP of `TangramClient.run` is limited by the default thread
pool (about 20 waiters at a time); here waiting costs one future per action.

A pop whose reply dies with Redis (a restart mid-reply) consumes its ids; every `poll_s` the
listener therefore also reads the state of every action still awaited, so no result is lost.

Like the blocking client, it checks actions with `ClientCore` and takes every Redis command
from `tangram_celery.store.client_ops`; `AsyncStore` only sends them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis

import tangram_celery.store.client_ops as ops
from tangram_celery.client.core import ClientCore, fork_action, forked
from tangram_celery.common.actions import new_id
from tangram_celery.common.admission import AnyAction, cancelled_result
from tangram_celery.common.config import TangramConfig, load_config
from tangram_celery.common.errors import ResultTimeout, TangramError
from tangram_celery.common.wire import ActionResult, PoolView
from tangram_celery.store.calls import Backoff
from tangram_celery.store.client_aio import AsyncStore
from tangram_celery.store.keys import notify_key
from tangram_celery.transport.broker import resolve_url

log = logging.getLogger("tangram.aclient")


class UnknownAction(TangramError):
    """No action with this id exists (never submitted, or its result expired after 24 h)."""


@dataclass
class _Waiter:
    future: asyncio.Future[ActionResult]  # the outcome, shared by every result() call
    refs: int = 0  # result() calls waiting on it
    # one per waiting result() call, woken directly when the outcome is set: one loop step to
    # the caller (a shielded future under wait_for took three)
    wakers: list[asyncio.Future[None]] = field(default_factory=list)

    def settle(self, result: ActionResult | None = None, error: BaseException | None = None) -> None:
        if self.future.done():
            return
        if error is not None:
            self.future.set_exception(error)
            self.future.exception()  # retrieved: no "never retrieved" log when nobody awaits it
        else:
            self.future.set_result(result)  # type: ignore[arg-type]
        for waker in self.wakers:
            if not waker.done():
                waker.set_result(None)


class AsyncActionHandle:
    """A submitted action; `await handle.result()` waits for it."""

    def __init__(self, client: AsyncTangramClient, action_id: str, trajectory_id: str) -> None:
        self.client = client
        self.id = action_id
        self.trajectory_id = trajectory_id

    async def result(self, timeout: float | None = 60.0) -> ActionResult:
        return await self.client.result(self.id, timeout)

    def __repr__(self) -> str:
        return f"AsyncActionHandle({self.id!r})"


class AsyncTangramClient:
    """Submit actions and await their results from asyncio code (one per process and event loop)."""

    def __init__(
        self,
        broker_url: str,
        *,
        config: TangramConfig | None = None,
        poll_s: float = 2.0,
        max_connections: int = 32,
        retry_budget_s: float = 120.0,
        tenant: str | None = None,
    ) -> None:
        self.url = broker_url
        self.config = config
        self.poll_s = poll_s
        self.retry_budget_s = retry_budget_s
        self.client_id = new_id()[:16]
        self.store = AsyncStore(
            broker_url, max_connections=max_connections, retry_budget_s=retry_budget_s, tenant=tenant
        )
        # whose work this client submits and reads: `tenant`, else its URL's Redis user's
        self.tenant = self.store.tenant
        self.notify = notify_key(self.store.qualified(self.client_id))
        self.core = ClientCore(config)
        self._waiters: dict[str, _Waiter] = {}
        self._read: list[str] = []  # results handed to their callers, not yet given READ_TTL_S
        self._listener: asyncio.Task[None] | None = None
        self._closed = False

    @classmethod
    def from_config(cls, path: str | os.PathLike[str], **kwargs: Any) -> AsyncTangramClient:
        cfg = load_config(path)
        return cls(resolve_url(cfg), config=cfg, **kwargs)

    # ---- plumbing ----------------------------------------------------------------------------
    async def languages(self) -> dict[str, list[str]]:
        """CPU node -> the languages its sandboxes run, as reported (cached LANGUAGES_TTL_S)."""
        now = time.monotonic()
        if self.core.wants_languages(now):
            self.core.saw_languages(await self.store.run(ops.languages()), now)
            self.core.saw_images(await self.store.run(ops.images()))
        return self.core.langs

    async def pools(self) -> PoolView | None:
        """The deployment's pools as this client checks actions against them, with the reported
        languages (`ClientCore.checked_view`); None until a scheduler has published them."""
        now = time.monotonic()
        if self.core.wants_view(now):
            self.core.saw_view(await self.store.run(ops.pool_view()), now)
        if self.core.view is None:
            return None  # no scheduler yet; it checks on intake, and we ask again next time
        await self.languages()
        return self.core.checked_view()

    def _ensure_listener(self) -> None:
        if self._closed:
            raise TangramError("this AsyncTangramClient is closed")
        if self._listener is None or self._listener.done():
            self._listener = asyncio.get_running_loop().create_task(
                self._listen_loop(), name="tangram-results"
            )

    # ---- submit ----------------------------------------------------------------------------
    async def submit(self, action: AnyAction | dict[str, Any]) -> AsyncActionHandle:
        """Validate and enqueue one action. Raises ActionRejected / AdmissionError, enqueuing nothing."""
        return (await self.submit_many([action]))[0]

    async def submit_many(self, actions: Iterable[AnyAction | dict[str, Any]]) -> list[AsyncActionHandle]:
        """Validate all, then enqueue all in one round trip. Nothing is enqueued if any is invalid."""
        now = time.time()
        await self.pools()
        batch = self.core.batch(actions, now)
        if not batch.items:
            return []
        self._ensure_listener()
        handles = [
            AsyncActionHandle(self, action_id, tid)
            for (action_id, _, _), tid in zip(batch.items, batch.trajectories, strict=True)
        ]
        # Waiters exist before the actions do: a result pushed before anyone awaits it is kept,
        # and `result()` needs no read of its own for an action submitted here.
        loop = asyncio.get_running_loop()
        fresh = [h.id for h in handles if h.id not in self._waiters]
        for action_id in fresh:
            self._waiters[action_id] = _Waiter(loop.create_future())
        try:
            again = await self.store.submit(
                batch.items,
                batch.max_queued,
                ttl_s=batch.queued_ttl_s,
                admit_memory_fraction=batch.admit_memory_fraction,
                notify=self.notify,
            )
        except BaseException:
            # the ones enqueued before the refusal are found by result() with a read of its own
            for action_id in fresh:
                self._waiters.pop(action_id, None)
            raise
        if again:  # submitted before (a retry): done already, or now waking this client
            await self._fetch(again)
        return handles

    async def run(self, action: AnyAction | dict[str, Any], timeout: float | None = 600.0) -> ActionResult:
        """Submit and wait for the result."""
        handle = await self.submit(action)
        return await self.result(handle.id, timeout)

    # ---- results ---------------------------------------------------------------------------
    async def result(self, action_id: str, timeout: float | None = 60.0) -> ActionResult:
        """The action's result, waiting up to `timeout` seconds (None: forever). Raises
        ResultTimeout (the action may still complete) or UnknownAction."""
        self._ensure_listener()
        w = self._waiters.get(action_id)
        fresh = w is None
        if w is None:
            w = self._waiters[action_id] = _Waiter(asyncio.get_running_loop().create_future())
        w.refs += 1
        try:
            if fresh:
                # Registered first, then read: a result stored in between is not missed.
                await self._fetch([action_id])
            if not w.future.done():
                waker: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                w.wakers.append(waker)
                try:
                    async with asyncio.timeout(timeout):
                        await waker
                finally:
                    w.wakers.remove(waker)
            return w.future.result()
        except TimeoutError:
            raise ResultTimeout(
                f"action {action_id} has no result after {timeout}s (it may still complete)"
            ) from None
        finally:
            w.refs -= 1
            if w.refs <= 0 and self._waiters.get(action_id) is w and not w.future.done():
                self._waiters.pop(action_id, None)

    async def state(self, action_id: str) -> str | None:
        """queued | dispatched | running | done | cancelled, or None if unknown."""
        return await self.store.run(ops.state(self.store.qualified(action_id)))

    async def peek(self, action_id: str) -> tuple[str | None, ActionResult | None]:
        """(state, result if final) without waiting."""
        state, raw = await self.store.run(ops.outcome(self.store.qualified(action_id)))
        return state, (None if raw is None else ActionResult.model_validate_json(raw))

    def _resolve(self, action_id: str, raw: str | ActionResult) -> None:
        w = self._waiters.pop(action_id, None)
        if w is not None and not w.future.done():
            try:
                result = raw if isinstance(raw, ActionResult) else ActionResult.model_validate_json(raw)
            except ValueError as e:
                w.settle(error=TangramError(f"unreadable result of {action_id}: {e}"))
                return
            w.settle(result)
            self._read.append(action_id)

    async def _expire_read(self, retry: bool = True) -> None:
        """Results handed to their callers are kept `READ_TTL_S` more instead of a day (see
        `tangram_celery.store.keys`): one pipeline for all, from the listener, off the callers'
        path (`retry` False: one try, as at close)."""
        ids, self._read = self._read, []
        q = self.store.qualified
        await self.store.run_all("expire read results", [ops.read_done(q(i)) for i in ids], retry=retry)

    def _deliver(self, raws: list[str]) -> None:
        """Resolve the waiters of the results popped from the notification list."""
        for raw in raws:
            try:
                result = ActionResult.model_validate_json(raw)
            except ValueError:
                log.warning("unreadable result on %s: %.200s", self.notify, raw)
                continue
            if result.action_id in self._waiters:
                self._resolve(result.action_id, result)

    async def _fetch(self, ids: list[str]) -> None:
        """Read the results of `ids` (those still awaited) and resolve their futures."""
        wanted = [i for i in ids if i in self._waiters]
        if not wanted:
            return

        q = self.store.qualified
        outcomes = await self.store.run_all("read results", [ops.outcome(q(i)) for i in wanted])
        for action_id, (state, raw) in zip(wanted, outcomes, strict=True):
            if raw is not None:
                self._resolve(action_id, raw)
            elif state is None:
                w = self._waiters.pop(action_id, None)
                if w is not None and not w.future.done() and w.refs > 0:
                    w.settle(
                        error=UnknownAction(
                            f"no action {action_id!r} (never submitted, or its result expired)"
                        )
                    )

    async def _listen_loop(self) -> None:
        next_sweep = time.monotonic() + self.poll_s
        backoff = Backoff("result listener", self.url, float("inf"), log)
        while not self._closed:
            try:
                got = await self.store.once(ops.pop_notified(self.notify, self.poll_s), listener=True)
                if got is not None:
                    self._deliver([got])  # first, before the drain's round trip
                    # the callers just woken answer before this task talks to Redis again
                    await asyncio.sleep(0)
                    if self._waiters:  # else the next BLPOP takes whatever is left
                        self._deliver(await self.store.once(ops.drain_notified(self.notify), listener=True))
                if time.monotonic() >= next_sweep:
                    # Results whose wake-up was lost (see the module docstring).
                    await self._fetch(list(self._waiters))
                    next_sweep = time.monotonic() + self.poll_s
                if self._read:
                    await self._expire_read()
                backoff = Backoff("result listener", self.url, float("inf"), log)  # from 0.05 s again
            except asyncio.CancelledError:
                raise
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                await asyncio.sleep(backoff.after(e))
                next_sweep = 0.0  # read everything once it is back
            except Exception:  # never let the one listener die silently
                log.exception("result listener failed; continuing")
                await asyncio.sleep(0.5)

    # ---- control ---------------------------------------------------------------------------
    async def cancel(self, action_id: str, reason: str = "cancelled by its caller") -> bool:
        """Withdraw an action that no scheduler has dispatched yet. True: it will never run and
        its result has status `cancelled`. False: already dispatched, finished, or unknown."""
        result_json = cancelled_result(action_id, reason)
        notify = await self.store.run(ops.notify_of(self.store.qualified(action_id)))
        return await self.store.run(ops.cancel(action_id, result_json, self.tenant, notify)) == "cancelled"

    async def fork(
        self, trajectory_id: str, n: int = 0, ids: list[str] | None = None, timeout: float | None = 600.0
    ) -> list[str]:
        """`TangramClient.fork`: new trajectories from a copy of one's files; their ids."""
        action, new = fork_action(trajectory_id, n, ids)
        return forked(trajectory_id, new, await self.run(action, timeout))

    async def close_trajectory(self, trajectory_id: str) -> None:
        """The trajectory is finished: its sandbox and reserved memory are released once its
        queued and running actions are done."""
        await self.store.run(ops.close_trajectory(trajectory_id, self.tenant))

    @property
    def outstanding(self) -> int:
        """Actions awaited right now."""
        return len(self._waiters)

    async def close(self) -> None:
        self._closed = True
        if self._listener is not None:
            self._listener.cancel()
            try:
                await self._listener
            except (asyncio.CancelledError, Exception):
                pass
        for w in self._waiters.values():
            w.settle(error=TangramError("client closed"))
        self._waiters.clear()
        try:
            await self.store.once(ops.forget_notified(self.notify))
            if self._read:
                await self._expire_read(retry=False)
        except redis.RedisError:
            pass
        await self.store.close()

    async def __aenter__(self) -> AsyncTangramClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
