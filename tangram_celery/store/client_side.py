"""The client side of the store: submit, cancel, wait for results, read the published pools.

`SubmitBatch`, `memory_refusal`, `check_submitted`, `cancel_keys` and `cancel_args` are shared
with the asyncio client (`tangram_celery.client.aio`), which runs the same scripts on its own
connection.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import NoScriptError

from tangram_celery.common.errors import ActionRejected, AdmissionError, BrokerError
from tangram_celery.common.wire import Completion, EventStatus, PoolView
from tangram_celery.store.base import StoreBase
from tangram_celery.store.keys import (
    CONFIG,
    EVENTS,
    GROUP,
    INTAKE,
    LANGS,
    READ_TTL_S,
    RESULT_TTL_S,
    akey,
    nkey,
)
from tangram_celery.store.scripts import SUBMIT


class ClientSide(StoreBase):
    def submit(
        self,
        items: Sequence[tuple[str, str, str]],
        max_queued: int,
        *,
        ttl_s: float = 0.0,
        admit_memory_fraction: float = 0.8,
    ) -> list[str]:
        """Enqueue (id, meta_json, payload_json) items atomically each; raise on the first refusal;
        return the ids that were submitted before (`check_submitted`).

        Items before a refused one stay enqueued (they are valid and were accepted). A payload
        not run within `ttl_s` expires (0 = never). When Redis has a `maxmemory` and uses more
        than `admit_memory_fraction` of it, nothing is enqueued (AdmissionError): the rest is
        headroom for results and scheduling, which must never be refused.
        """
        self._admit_memory(admit_memory_fraction, len(items))
        ttl = str(int(ttl_s)) if ttl_s > 0 else "0"

        def send() -> list[Any]:
            batch = SubmitBatch(self._submit.sha, items, max_queued, ttl, notify="")
            while True:
                pipe = self.r.pipeline(transaction=False)
                for call in batch.pending():
                    pipe.evalsha(*call)
                if batch.take(pipe.execute(raise_on_error=False)):
                    return batch.replies
                self.r.script_load(SUBMIT)

        return check_submitted(items, self.retrying("submit", send), max_queued)

    def _admit_memory(self, fraction: float, n: int) -> None:
        """AdmissionError when Redis is above `fraction` of its maxmemory (checked at most every
        0.25 s per Store: INFO is cheap but not free)."""
        now = time.monotonic()
        if now - self._mem_checked_s > 0.25:
            self._mem = self.memory_use()
            self._mem_checked_s = now
        why = memory_refusal(*self._mem, fraction, n)
        if why is not None:
            self._mem_checked_s = 0.0  # look again next time: it drains as actions finish
            raise AdmissionError(why)

    def control(self, fields: dict[str, str]) -> None:
        # sent again after a lost reply: a control (close) applied twice changes nothing more
        self.retrying("control", lambda: self.r.xadd(INTAKE, dict(fields.items())))

    def cancel(self, action_id: str, result_json: str) -> str:
        """Cancel an action that no scheduler has dispatched yet; 'cancelled' if it was, else
        its state ('dispatched', 'running', 'done', 'cancelled', or 'missing'), untouched."""
        keys, args = cancel_keys(action_id), cancel_args(action_id, result_json)
        # a second run after a lost reply finds it 'cancelled' already, which is the answer
        return str(self.retrying("cancel", lambda: self._cancel(keys=keys, args=args)))

    def wait_result(
        self, action_id: str, timeout_s: float | None, poll_s: float = 2.0, look_first: bool = False
    ) -> str | None:
        """Block until the action's result exists; return its JSON, or None on timeout.

        The completion script stores the result in the action's hash (the truth) and pushes a
        copy onto `n:<id>` to wake the waiter. The push is consumed by whoever pops it, and a
        pop whose reply was lost (Redis died mid-reply) consumes it too, so the waiter never
        relies on it alone: every `poll_s` without a wake-up it reads the hash. `look_first`: read
        it before the first wait (the action may have completed before this waiter existed:
        a resubmission, or a handle made for an earlier client's action).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        wait = not look_first  # (else the first pass reads the hash without waiting)
        while True:
            left = poll_s if deadline is None else min(poll_s, deadline - time.monotonic())
            if wait and left > 0:

                def pop(t: float = left) -> Any:
                    return self.r.blpop([nkey(action_id)], timeout=max(t, 0.001))

                got = self.retrying("wait for result", pop)
                if got is not None:
                    self.read_done(action_id)
                    return str(got[1])
            wait = True
            res = self.retrying("wait for result", lambda: self.r.hget(akey(action_id), "result"))
            if res is not None:
                self.read_done(action_id)
                return str(res)
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def read_done(self, action_id: str) -> None:
        """Its caller has the result: keep it `READ_TTL_S` more instead of the day an unread one
        gets (`RESULT_TTL_S`, for a caller that died before reading)."""
        self.retrying("expire a read result", lambda: self.r.expire(akey(action_id), READ_TTL_S))

    def action_state(self, action_id: str) -> str | None:
        s = self.retrying("read state", lambda: self.r.hget(akey(action_id), "state"))
        return None if s is None else str(s)

    def pool_view(self) -> PoolView | None:
        """The pools the scheduler published (None before any scheduler has)."""
        raw = self.retrying("read config", lambda: self.r.get(CONFIG))
        return None if raw is None else PoolView.model_validate_json(str(raw))

    def languages(self) -> dict[str, list[str]]:
        """CPU node -> the languages its sandboxes run, as its worker reported them."""
        return languages_of(self.retrying("read languages", lambda: self.r.hgetall(LANGS)))

    def queued_count(self) -> int:
        return int(self.retrying("queue length", lambda: self.r.xlen(INTAKE)))


class SubmitBatch:
    """The submit script's calls for a batch of (id, meta, payload) items, sent by digest
    (EVALSHA) in one round trip. (A pipeline of `Script` calls asks SCRIPT EXISTS first: a
    second round trip on every submit.) An item that met an empty script cache (a restarted
    Redis) did not run: `take` says so, and after a SCRIPT LOAD `pending` holds those items
    again, once; a second miss is left as the item's reply (an error for `check_submitted`)."""

    def __init__(
        self, sha: str, items: Sequence[tuple[str, str, str]], max_queued: int, ttl: str, notify: str
    ) -> None:
        self.calls = [
            (sha, 2, INTAKE, akey(i), i, meta, payload, max_queued, ttl, notify) for i, meta, payload in items
        ]
        self.replies: list[Any] = [None] * len(self.calls)
        self._todo = list(range(len(self.calls)))
        self._rounds = 0

    def pending(self) -> list[tuple[Any, ...]]:
        """EVALSHA arguments of the items still to send."""
        return [self.calls[n] for n in self._todo]

    def take(self, replies: Sequence[Any]) -> bool:
        """Record the replies to `pending()`; True when done, False to load the script and send
        `pending()` again."""
        for n, rep in zip(self._todo, replies, strict=True):
            self.replies[n] = rep
        self._rounds += 1
        self._todo = [n for n in self._todo if isinstance(self.replies[n], NoScriptError)]
        return not self._todo or self._rounds >= 2


def memory_refusal(used_b: int, max_b: int, fraction: float, n: int) -> str | None:
    """Why nothing may be enqueued while Redis uses `used_b` of its `max_b` maxmemory (None: fine)."""
    if max_b > 0 and used_b > fraction * max_b:
        return (
            f"broker full: Redis uses {used_b >> 20} MiB of its {max_b >> 20} MiB maxmemory "
            f"(admission stops at {fraction:.0%}); none of these {n} action(s) were enqueued, "
            "retry later or raise broker.maxmemory_mb"
        )
    return None


def check_submitted(
    items: Sequence[tuple[str, str, str]], replies: Sequence[Any], max_queued: int
) -> list[str]:
    """Raise for the first item the submit script refused (the ones before it were enqueued);
    else the ids of the items that were submitted before (same id and payload: a retry). Their
    results may exist already, so their waiters read first instead of waiting for a wake-up."""
    for n, ((action_id, _, _), rep) in enumerate(zip(items, replies, strict=True)):
        if isinstance(rep, redis.ResponseError):
            msg = str(rep)
            if "TANGRAM_FULL" in msg:
                raise AdmissionError(
                    f"intake is full ({max_queued} actions waiting): the first {n} of this "
                    f"batch were enqueued, action {action_id} and the rest were not; retry "
                    "them later or raise scheduler.max_queued"
                )
            if "TANGRAM_DUPLICATE" in msg:
                raise ActionRejected(f"action id {action_id!r} was already submitted")
            if msg.startswith("OOM"):
                raise AdmissionError(
                    f"broker full (Redis maxmemory reached): the first {n} of this batch were "
                    f"enqueued, action {action_id} and the rest were not; retry them later"
                )
            raise BrokerError(f"submit of {action_id} failed: {msg}")
        if isinstance(rep, Exception):
            raise BrokerError(f"submit of {action_id} failed: {rep}")
    return [action_id for (action_id, _, _), rep in zip(items, replies, strict=True) if rep == "already"]


def cancel_keys(action_id: str) -> list[str]:
    return [akey(action_id), nkey(action_id), EVENTS, INTAKE]


def cancel_args(action_id: str, result_json: str) -> list[Any]:
    return [
        action_id,
        result_json,
        Completion(status=EventStatus.CANCELLED).model_dump_json(),
        RESULT_TTL_S,
        GROUP,
    ]


def languages_of(raw: dict[Any, Any]) -> dict[str, list[str]]:
    """The `tangram:languages` hash decoded (entries that do not parse are left out)."""
    import json

    out: dict[str, list[str]] = {}
    for node, value in raw.items():
        try:
            langs = json.loads(value)
        except ValueError:
            continue
        if isinstance(langs, list):
            out[node.decode() if isinstance(node, bytes) else str(node)] = [str(x) for x in langs]
    return out
