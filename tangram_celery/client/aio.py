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
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
import redis.asyncio as aredis

from tangram_celery.common.actions import ActionResult, new_id
from tangram_celery.common.admission import (
    LANGUAGES_TTL_S,
    AnyAction,
    admit,
    cancelled_result,
    coerce_action,
    limits_from_view,
)
from tangram_celery.common.config import TangramConfig, load_config
from tangram_celery.common.errors import (
    ActionRejected,
    AdmissionError,
    BrokerError,
    ResultTimeout,
    TangramError,
)
from tangram_celery.common.wire import PoolView
from tangram_celery.store import (
    CANCEL,
    CONFIG,
    INTAKE,
    LANGS,
    READ_TTL_S,
    SUBMIT,
    SubmitBatch,
    akey,
    cancel_args,
    cancel_keys,
    check_submitted,
    languages_of,
    memory_refusal,
    notify_key,
    redact,
)
from tangram_celery.transport.broker import resolve_url

log = logging.getLogger("tangram.aclient")
T = TypeVar("T")
_FINAL = ("done", "cancelled")


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
    ) -> None:
        self.url = broker_url
        self.config = config
        self.poll_s = poll_s
        self.retry_budget_s = retry_budget_s
        self.client_id = new_id()[:16]
        self.notify = notify_key(self.client_id)
        # Commands share a small pool (a full pool makes callers wait their turn, it does not
        # fail them); the listener holds its own connection in BLPOP.
        pool = aredis.BlockingConnectionPool.from_url(
            broker_url,
            decode_responses=True,
            max_connections=max_connections,
            timeout=None,
            socket_timeout=30.0,
            health_check_interval=30,
        )
        self.r = aredis.Redis(connection_pool=pool)
        self._listen = aredis.Redis.from_url(
            broker_url, decode_responses=True, single_connection_client=True, socket_timeout=None
        )
        self._submit = self.r.register_script(SUBMIT)
        self._cancel = self.r.register_script(CANCEL)
        self._view: PoolView | None = PoolView.of(config) if config else None
        self._view_read = config is not None
        self._langs: dict[str, list[str]] = {}  # CPU node -> languages, as its worker reported
        self._langs_read_s = float("-inf")
        self._checked: tuple[PoolView, dict[str, list[str]], PoolView] | None = None
        self._waiters: dict[str, _Waiter] = {}
        self._read: list[str] = []  # results handed to their callers, not yet given READ_TTL_S
        self._listener: asyncio.Task[None] | None = None
        self._closed = False
        self._mem: tuple[int, int] = (0, 0)  # (used, max) bytes of Redis memory, last read
        self._mem_checked_s = float("-inf")

    @classmethod
    def from_config(cls, path: str | os.PathLike[str], **kwargs: Any) -> AsyncTangramClient:
        cfg = load_config(path)
        return cls(resolve_url(cfg), config=cfg, **kwargs)

    # ---- plumbing ----------------------------------------------------------------------------
    async def _retrying(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """`fn()`, retried with backoff while Redis is unreachable (idempotent operations only)."""
        deadline = time.monotonic() + self.retry_budget_s
        delay_s = 0.05
        while True:
            try:
                return await fn()
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if time.monotonic() + delay_s > deadline:
                    raise BrokerError(f"{what}: Redis at {redact(self.url)} unreachable: {e}") from e
                log.warning("%s: Redis unreachable (%s); retrying in %.2fs", what, e, delay_s)
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 1.0)

    async def _pool_view(self) -> PoolView | None:
        if not self._view_read:
            raw = await self._retrying("read config", lambda: self.r.get(CONFIG))
            if raw is None:
                return None  # no scheduler yet; it checks on intake, and we ask again next time
            self._view, self._view_read = PoolView.model_validate_json(raw), True
        return self._view

    async def languages(self) -> dict[str, list[str]]:
        """CPU node -> the languages its sandboxes run, as reported (cached LANGUAGES_TTL_S)."""
        now = time.monotonic()
        if now - self._langs_read_s > LANGUAGES_TTL_S:
            raw = await self._retrying("read languages", lambda: self.r.hgetall(LANGS))
            self._langs, self._langs_read_s = languages_of(raw), now
        return self._langs

    async def _checked_view(self) -> PoolView | None:
        """The pool view with the reported languages (rebuilt only when either changes)."""
        view = await self._pool_view()
        if view is None:
            return None
        langs = await self.languages()
        cached = self._checked
        if cached is None or cached[0] is not view or cached[1] is not langs:
            cached = self._checked = (view, langs, view.with_languages(langs))
        return cached[2]

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
        view = await self._checked_view()
        limits = self.config.limits if self.config else limits_from_view(view)
        items: list[tuple[str, str, str]] = []
        handles: list[AsyncActionHandle] = []
        seen: set[str] = set()
        for raw in actions:
            action = coerce_action(raw)
            if action.id in seen:
                raise ActionRejected(f"action id {action.id!r} appears twice in one submit")
            seen.add(action.id)
            items.append(admit(action, view, limits, now))
            handles.append(AsyncActionHandle(self, action.id, action.trajectory_id or ""))
        if not items:
            return []
        self._ensure_listener()
        max_queued = view.max_queued if view else 0
        fraction = view.admit_memory_fraction if view else 0.8
        await self._admit_memory(fraction, len(items))
        ttl = str(int(limits.queued_ttl_s)) if limits.queued_ttl_s > 0 else "0"

        async def send() -> list[Any]:
            return await self._run_submits(items, max_queued, ttl)

        # Waiters exist before the actions do: a result pushed before anyone awaits it is kept,
        # and `result()` needs no read of its own for an action submitted here.
        loop = asyncio.get_running_loop()
        fresh = [h.id for h in handles if h.id not in self._waiters]
        for action_id in fresh:
            self._waiters[action_id] = _Waiter(loop.create_future())
        try:
            again = check_submitted(items, await self._retrying("submit", send), max_queued)
        except BaseException:
            # the ones enqueued before the refusal are found by result() with a read of its own
            for action_id in fresh:
                self._waiters.pop(action_id, None)
            raise
        if again:  # submitted before (a retry): done already, or now waking this client
            await self._fetch(again)
        return handles

    async def _run_submits(self, items: list[tuple[str, str, str]], max_queued: int, ttl: str) -> list[Any]:
        """The submit script's reply per item, errors as values, in one round trip (`SubmitBatch`);
        a single item without a pipeline."""
        batch = SubmitBatch(self._submit.sha, items, max_queued, ttl, self.notify)
        while True:
            calls = batch.pending()
            if len(calls) == 1:
                try:
                    got: list[Any] = [await self.r.evalsha(*calls[0])]
                except redis.ResponseError as e:  # refusals are values, as in a pipeline
                    got = [e]
            else:
                pipe = self.r.pipeline(transaction=False)
                for call in calls:
                    pipe.evalsha(*call)
                got = list(await pipe.execute(raise_on_error=False))
            if batch.take(got):
                return batch.replies
            await self.r.script_load(SUBMIT)

    async def _admit_memory(self, fraction: float, n: int) -> None:
        """AdmissionError while Redis is above `fraction` of its maxmemory (read at most every
        0.25 s), as `Store.submit` does."""
        now = time.monotonic()
        if now - self._mem_checked_s > 0.25:
            info = await self._retrying("memory check", lambda: self.r.info("memory"))
            self._mem = (int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)))
            self._mem_checked_s = now
        why = memory_refusal(*self._mem, fraction, n)
        if why is not None:
            self._mem_checked_s = float("-inf")
            raise AdmissionError(why)

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
        s = await self._retrying("read state", lambda: self.r.hget(akey(action_id), "state"))
        return None if s is None else str(s)

    async def peek(self, action_id: str) -> tuple[str | None, ActionResult | None]:
        """(state, result if final) without waiting."""
        state, raw = await self._retrying(
            "read result", lambda: self.r.hmget(akey(action_id), ["state", "result"])
        )
        result = ActionResult.model_validate_json(raw) if raw is not None and state in _FINAL else None
        return (None if state is None else str(state)), result

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

        async def expire() -> list[Any]:
            pipe = self.r.pipeline(transaction=False)
            for i in ids:
                pipe.expire(akey(i), READ_TTL_S)
            return list(await pipe.execute())

        await (self._retrying("expire read results", expire) if retry else expire())

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

        async def read() -> list[Any]:
            pipe = self.r.pipeline(transaction=False)
            for i in wanted:
                pipe.hmget(akey(i), ["state", "result"])
            return list(await pipe.execute())

        for action_id, (state, raw) in zip(wanted, await self._retrying("read results", read), strict=True):
            if raw is not None and state in _FINAL:
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
        delay_s = 0.05
        while not self._closed:
            try:
                got = await self._listen.blpop([self.notify], timeout=self.poll_s)
                if got is not None:
                    self._deliver([str(got[1])])  # first, before the drain's round trip
                    # the callers just woken answer before this task talks to Redis again
                    await asyncio.sleep(0)
                    if self._waiters:  # else the next BLPOP takes whatever is left
                        more = await self._listen.lpop(self.notify, 4096)
                        if more:
                            self._deliver([str(x) for x in more])
                if time.monotonic() >= next_sweep:
                    # Results whose wake-up was lost (see the module docstring).
                    await self._fetch(list(self._waiters))
                    next_sweep = time.monotonic() + self.poll_s
                if self._read:
                    await self._expire_read()
                delay_s = 0.05
            except asyncio.CancelledError:
                raise
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                log.warning("result listener: Redis unreachable (%s); retrying in %.2fs", e, delay_s)
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 1.0)
                next_sweep = 0.0  # read everything once it is back
            except Exception:  # never let the one listener die silently
                log.exception("result listener failed; continuing")
                await asyncio.sleep(0.5)

    # ---- control ---------------------------------------------------------------------------
    async def cancel(self, action_id: str, reason: str = "cancelled by its caller") -> bool:
        """Withdraw an action that no scheduler has dispatched yet. True: it will never run and
        its result has status `cancelled`. False: already dispatched, finished, or unknown."""
        rep = await self._retrying(
            "cancel",
            lambda: self._cancel(
                keys=cancel_keys(action_id), args=cancel_args(action_id, cancelled_result(action_id, reason))
            ),
        )
        return str(rep) == "cancelled"

    async def close_trajectory(self, trajectory_id: str) -> None:
        """The trajectory is finished: its sandbox and reserved memory are released once its
        queued and running actions are done."""
        await self._retrying(
            "close trajectory",
            lambda: self.r.xadd(INTAKE, {"control": "close", "trajectory_id": trajectory_id}),
        )

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
            await self.r.delete(self.notify)
            if self._read:
                await self._expire_read(retry=False)
        except redis.RedisError:
            pass
        await self._listen.aclose()
        await self.r.aclose()
        await self.r.connection_pool.disconnect()  # a pool passed in is not closed by aclose

    async def __aenter__(self) -> AsyncTangramClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
