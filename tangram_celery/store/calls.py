"""A Redis command as a value, and the backoff while Redis is away: what the blocking and the
asyncio executors of the store share, without I/O.

An operation of the store is built as `Call`s (`client_ops.py`); an executor only sends them
(`redis.Redis` in `base.py`, `redis.asyncio` in `client_aio.py`) and hands each reply to the
call's `parse`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import redis

from tangram_celery.common.errors import BrokerError
from tangram_celery.store.keys import redact

log = logging.getLogger("tangram.store")
T = TypeVar("T")


class ScriptNotLoaded(redis.ConnectionError):
    """Redis's script cache lacks a script and this user may not load one (a tenant's: it runs
    only the scripts the scheduler loaded, `SchedulerSide.load_client_scripts`, so that no
    client can run a script of its own, such as one that never ends). The scheduler loads them
    within a second of a Redis restart: retried like a connection that went away."""


# What a retry may cure (a restart, a failover); the asyncio client raises the same classes.
RETRYABLE: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError)


def not_loaded(script: str, e: redis.exceptions.NoPermissionError) -> ScriptNotLoaded:
    """The error for a script this user could not load (`e`: Redis's refusal)."""
    head = script.strip().splitlines()[0][:60] if script.strip() else ""
    return ScriptNotLoaded(
        f"script not loaded yet (the scheduler loads it), and this user may not: {e} [{head}]"
    )


@dataclass(frozen=True)
class Call(Generic[T]):
    """One Redis command: a method of the redis-py client (the same name and arguments in
    `redis` and `redis.asyncio`), and how its reply reads.

    `script`: the Lua source of an EVALSHA call, loaded and the call sent once more when Redis
    has not got it (a restarted Redis); `what` names the operation in errors and logs."""

    what: str
    method: str
    args: tuple[Any, ...]
    parse: Callable[[Any], T]
    kwargs: dict[str, Any] = field(default_factory=dict)
    script: str | None = None


class Backoff:
    """The waits between tries of an operation while Redis is unreachable: 0.05 s, doubling up
    to 1 s, until `budget_s` is spent (then BrokerError)."""

    def __init__(self, what: str, url: str, budget_s: float, logger: logging.Logger = log) -> None:
        self.what = what
        self.log = logger
        self.url = url
        self.deadline = time.monotonic() + budget_s
        self.delay_s = 0.05

    def after(self, error: Exception) -> float:
        """Seconds to wait before the next try after `error`; BrokerError when the budget would
        be spent by then."""
        delay_s = self.delay_s
        why = "waiting for the scheduler's scripts" if isinstance(error, ScriptNotLoaded) else "unreachable"
        if time.monotonic() + delay_s > self.deadline:
            raise BrokerError(f"{self.what}: Redis at {redact(self.url)} {why}: {error}") from error
        self.log.warning("%s: Redis %s (%s); retrying in %.2fs", self.what, why, error, delay_s)
        self.delay_s = min(delay_s * 2, 1.0)
        return delay_s
