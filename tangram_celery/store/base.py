"""The connection every side of the store shares, retrying while Redis is away, and sending
the calls that `client_ops` builds (the blocking executor; `client_aio` is the asyncio one)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlparse

import redis
from redis.exceptions import NoScriptError

import tangram_celery.store.client_ops as ops
import tangram_celery.store.scripts as scripts
from tangram_celery.common import tenants
from tangram_celery.common.errors import BrokerError
from tangram_celery.common.wire import Completion
from tangram_celery.store.calls import RETRYABLE, Backoff, Call, not_loaded
from tangram_celery.store.keys import EVENTS, RESULT_TTL_S, akey, nkey, redact

T = TypeVar("T")
log = logging.getLogger("tangram.store")


def tenant_of_url(url: str) -> str:
    """The tenant a broker URL acts as: its Redis user's (`tenants.tenant_of_user`)."""
    try:
        return tenants.tenant_of_user(urlparse(url).username)
    except ValueError:
        return tenants.DEFAULT


def caller_result(action_id: str, result_json: str) -> str:
    """The result as its caller reads it: with the caller's own action and trajectory ids (a
    named tenant's qualified ids stripped, `tenants.local`); the default tenant's unchanged."""
    if tenants.SEP not in action_id:
        return result_json
    data = json.loads(result_json)
    data["action_id"] = tenants.local(str(data.get("action_id") or action_id))
    if data.get("trajectory_id"):
        data["trajectory_id"] = tenants.local(str(data["trajectory_id"]))
    return json.dumps(data)


class StoreBase:
    """One Redis connection pool and the registered scripts.

    `client`: an already made Redis client to use instead of connecting to `url` (the
    in-memory twin of `tangram_celery.testing` passes one); it must decode responses.
    `tenant`: whose work a client side acts on (default: the URL's Redis user's,
    `tenant_of_url`); the scheduler's and workers' sides act on ids qualified with theirs."""

    def __init__(
        self,
        url: str,
        *,
        socket_timeout_s: float | None = 30.0,
        retry_budget_s: float = 120.0,
        client: redis.Redis | None = None,
        tenant: str | None = None,
    ) -> None:
        self.url = url
        self.tenant = tenants.valid_name(tenant) if tenant is not None else tenant_of_url(url)
        self.retry_budget_s = retry_budget_s
        self.r: redis.Redis = client or redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=socket_timeout_s, health_check_interval=30
        )
        self._claim = self.r.register_script(scripts.CLAIM)
        self._complete = self.r.register_script(scripts.COMPLETE)
        self._notify = self.r.register_script(scripts.NOTIFY)
        self._requeue = self.r.register_script(scripts.REQUEUE)
        self._give_back = self.r.register_script(scripts.GIVE_BACK)
        self._heartbeat = self.r.register_script(scripts.HEARTBEAT)
        self._dispatch = self.r.register_script(scripts.DISPATCH)
        self._memory = ops.MemoryCheck()

    def qualified(self, local_id: str) -> str:
        """The id between processes of this side's tenant's `local_id` (`tenants.qualify`)."""
        return tenants.qualify(self.tenant, local_id)

    def retrying(self, what: str, fn: Callable[[], T], budget_s: float | None = None) -> T:
        """Run `fn`, retrying with backoff while Redis is unreachable (restarts, failovers).

        Only idempotent operations go through here. Raises BrokerError when the budget is spent.
        """
        backoff = Backoff(what, self.url, self.retry_budget_s if budget_s is None else budget_s)
        while True:
            try:
                return fn()
            except RETRYABLE as e:
                time.sleep(backoff.after(e))

    def run(self, call: Call[T]) -> T:
        """Send `call` (retried while Redis is unreachable) and read its reply."""
        return call.parse(self.retrying(call.what, lambda: self._send(call)))

    def _send(self, call: Call[Any]) -> Any:
        send = getattr(self.r, call.method)
        try:
            return send(*call.args, **call.kwargs)
        except NoScriptError:
            if call.script is None:
                raise
            self.load_script(call.script)  # a restarted Redis: load it, send once more
            return send(*call.args, **call.kwargs)

    def load_script(self, script: str) -> None:
        """SCRIPT LOAD `script`; ScriptNotLoaded (retried) for a user that may not (a tenant's)."""
        try:
            self.r.script_load(script)
        except redis.exceptions.NoPermissionError as e:
            raise not_loaded(script, e) from None

    def send_all(self, calls: Sequence[Call[Any]], raise_on_error: bool = True) -> list[Any]:
        """The raw replies to `calls`, in one round trip (errors as values unless
        `raise_on_error`); not retried, and a script Redis lacks is not loaded here."""
        pipe = self.r.pipeline(transaction=False)
        for call in calls:
            getattr(pipe, call.method)(*call.args, **call.kwargs)
        return list(pipe.execute(raise_on_error=raise_on_error))

    def ping(self) -> None:
        try:
            self.r.ping()
        except redis.RedisError as e:
            raise BrokerError(f"cannot reach Redis at {redact(self.url)}: {e}") from e

    def close(self) -> None:
        self.r.close()

    def redis_memory(self) -> tuple[int, int]:
        """(used, maxmemory) bytes of Redis memory (maxmemory 0: no ceiling), from INFO."""
        return self.run(ops.memory_use())

    def memory_use(self) -> tuple[int, int]:
        """(used, maxmemory) bytes of Redis memory as the scheduler publishes it (`keys.MEMORY`);
        before it has, INFO for the default tenant, no ceiling for a named one (whose user may
        not read INFO)."""
        got = self.run(ops.published_memory())
        if got is not None:
            return got
        if self.tenant != tenants.DEFAULT:
            return 0, 0
        try:
            return self.redis_memory()
        except redis.exceptions.NoPermissionError:
            return 0, 0

    def _finish(self, action_id: str, result_json: str, event: Completion, notify: str | None = None) -> bool:
        """running -> done (any state but done and cancelled): store the result (with the
        caller's own ids, `caller_result`), wake its waiter, emit the completion event. False if
        it was already final. `notify`: the notification list the hash named when the action
        was claimed ("" for none); None: read it now."""
        ev = event.model_dump_json(exclude_none=True)
        if notify is None:
            raw: Any = self.retrying("read notify", lambda: self.r.hget(akey(action_id), "notify"))
            notify = None if raw is None else str(raw)
        keys = [akey(action_id), nkey(action_id), EVENTS, ops.checked_notify(action_id, notify)]
        args: list[Any] = [action_id, caller_result(action_id, result_json), ev, RESULT_TTL_S]
        rep = self.retrying("complete", lambda: self._complete(keys=keys, args=args))
        if isinstance(rep, str | bytes):  # the hash names another list now: wake it, if ours
            other = rep.decode() if isinstance(rep, bytes) else rep
            keys = [akey(action_id), nkey(action_id), ops.checked_notify(action_id, other)]
            self.retrying("notify", lambda: self._notify(keys=keys, args=[args[1], RESULT_TTL_S]))
        return bool(rep)
