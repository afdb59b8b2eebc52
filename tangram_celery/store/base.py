"""The connection every side of the store shares, and retrying while Redis is away."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from tangram_celery.common.errors import BrokerError
from tangram_celery.common.wire import Completion
from tangram_celery.store import scripts
from tangram_celery.store.keys import EVENTS, RESULT_TTL_S, akey, nkey, redact

log = logging.getLogger("tangram.store")
T = TypeVar("T")


class StoreBase:
    """One Redis connection pool and the registered scripts.

    `client`: an already made Redis client to use instead of connecting to `url` (the
    in-memory twin of `tangram_celery.testing` passes one); it must decode responses."""

    def __init__(
        self,
        url: str,
        *,
        socket_timeout_s: float | None = 30.0,
        retry_budget_s: float = 120.0,
        client: redis.Redis | None = None,
    ) -> None:
        self.url = url
        self.retry_budget_s = retry_budget_s
        self.r: redis.Redis = client or redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=socket_timeout_s, health_check_interval=30
        )
        self._submit = self.r.register_script(scripts.SUBMIT)
        self._claim = self.r.register_script(scripts.CLAIM)
        self._complete = self.r.register_script(scripts.COMPLETE)
        self._requeue = self.r.register_script(scripts.REQUEUE)
        self._give_back = self.r.register_script(scripts.GIVE_BACK)
        self._heartbeat = self.r.register_script(scripts.HEARTBEAT)
        self._cancel = self.r.register_script(scripts.CANCEL)
        self._dispatch = self.r.register_script(scripts.DISPATCH)
        self._mem: tuple[int, int] = (0, 0)  # (used, max) bytes of Redis memory, last read
        self._mem_checked_s = float("-inf")

    def retrying(self, what: str, fn: Callable[[], T], budget_s: float | None = None) -> T:
        """Run `fn`, retrying with backoff while Redis is unreachable (restarts, failovers).

        Only idempotent operations go through here. Raises BrokerError when the budget is spent.
        """
        deadline = time.monotonic() + (self.retry_budget_s if budget_s is None else budget_s)
        delay_s = 0.05
        while True:
            try:
                return fn()
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if time.monotonic() + delay_s > deadline:
                    raise BrokerError(f"{what}: Redis at {redact(self.url)} unreachable: {e}") from e
                log.warning("%s: Redis unreachable (%s); retrying in %.2fs", what, e, delay_s)
                time.sleep(delay_s)
                delay_s = min(delay_s * 2, 1.0)

    def ping(self) -> None:
        try:
            self.r.ping()
        except redis.RedisError as e:
            raise BrokerError(f"cannot reach Redis at {redact(self.url)}: {e}") from e

    def close(self) -> None:
        self.r.close()

    def memory_use(self) -> tuple[int, int]:
        """(used, maxmemory) bytes of Redis memory (maxmemory 0: no ceiling)."""
        info = self.retrying("memory check", lambda: self.r.info("memory"))
        return int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))

    def _finish(self, action_id: str, result_json: str, event: Completion) -> bool:
        """running -> done (any state but done and cancelled): store the result, wake its
        waiter, emit the completion event. False if it was already final."""
        ev = event.model_dump_json(exclude_none=True)
        rep = self.retrying(
            "complete",
            lambda: self._complete(
                keys=[akey(action_id), nkey(action_id), EVENTS],
                args=[action_id, result_json, ev, RESULT_TTL_S],
            ),
        )
        return bool(rep)
