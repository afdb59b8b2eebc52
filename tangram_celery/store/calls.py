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

# What a retry may cure (a restart, a failover); the asyncio client raises the same classes.
RETRYABLE: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError)


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
        if time.monotonic() + delay_s > self.deadline:
            raise BrokerError(f"{self.what}: Redis at {redact(self.url)} unreachable: {error}") from error
        self.log.warning("%s: Redis unreachable (%s); retrying in %.2fs", self.what, error, delay_s)
        self.delay_s = min(delay_s * 2, 1.0)
        return delay_s
