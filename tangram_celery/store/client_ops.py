"""The client side of the store without I/O: the Redis commands of every client operation
(keys, scripts, arguments) and how their replies read.

Both clients carry out the same calls: `TangramClient` through the blocking `Store`
(`client_side.py`), `AsyncTangramClient` through `AsyncStore` (`client_aio.py`). What differs
between them is only how a call is sent, and how a result is waited for: one BLPOP per action
(`pop_result`), or one list per asyncio client process (`notify_key`, `pop_notified`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import NoScriptError

from tangram_celery.common.errors import ActionRejected, AdmissionError, BrokerError
from tangram_celery.common.tenants import DEFAULT, qualify, tenant_of
from tangram_celery.common.wire import PoolView
from tangram_celery.store.calls import Call
from tangram_celery.store.keys import (
    CONFIG,
    GROUP,
    IMAGES,
    LANGS,
    MEMORY,
    READ_TTL_S,
    RESULT_TTL_S,
    ActionState,
    akey,
    intake_key,
    limits_key,
    nkey,
    notify_prefix,
)
from tangram_celery.store.scripts import CANCEL, SUBMIT

log = logging.getLogger("tangram.store")

Item = tuple[str, str, str]  # (action id, meta JSON, payload JSON), as `admit` makes them
FINAL = (ActionState.DONE, ActionState.CANCELLED)
MEMORY_CHECK_S = 0.25  # Redis's memory use is read at most this often per client (INFO)
DRAIN_MAX = 4096  # results taken off a notification list in one LPOP


def _sha(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


SUBMIT_SHA = _sha(SUBMIT)
CANCEL_SHA = _sha(CANCEL)
# digest -> script: what clients run by EVALSHA; the scheduler keeps them loaded, since a
# tenant's user may not load a script (`transport.acl.tenant_rules`)
CLIENT_SCRIPTS = {SUBMIT_SHA: SUBMIT, CANCEL_SHA: CANCEL}


def _text(reply: Any) -> str | None:
    return None if reply is None else str(reply)


def _nothing(reply: Any) -> None:
    return None


# ---- reads ----------------------------------------------------------------------------------
def state(action_id: str) -> Call[str | None]:
    """queued | dispatched | running | done | cancelled, or None (no such action)."""
    return Call("read state", "hget", (akey(action_id), "state"), _text)


def stored_result(action_id: str) -> Call[str | None]:
    """The result's JSON in the action's hash (the truth), None while it has none."""
    return Call("wait for result", "hget", (akey(action_id), "result"), _text)


def _outcome(reply: Any) -> tuple[str | None, str | None]:
    state, raw = reply
    return _text(state), (str(raw) if raw is not None and state in FINAL else None)


def outcome(action_id: str) -> Call[tuple[str | None, str | None]]:
    """(state, the result's JSON if the action is final)."""
    return Call("read result", "hmget", (akey(action_id), ["state", "result"]), _outcome)


def pool_view() -> Call[PoolView | None]:
    """The pools the scheduler published (None before any scheduler has)."""
    return Call(
        "read config",
        "get",
        (CONFIG,),
        lambda raw: None if raw is None else PoolView.model_validate_json(str(raw)),
    )


def languages_of(raw: dict[Any, Any]) -> dict[str, list[str]]:
    """The `tangram:languages` hash decoded (entries that do not parse are left out)."""
    out: dict[str, list[str]] = {}
    for node, value in raw.items():
        try:
            langs = json.loads(value)
        except ValueError:
            continue
        if isinstance(langs, list):
            out[node.decode() if isinstance(node, bytes) else str(node)] = [str(x) for x in langs]
    return out


def languages() -> Call[dict[str, list[str]]]:
    """CPU node -> the languages its sandboxes run, as its worker reported them."""
    return Call("read languages", "hgetall", (LANGS,), languages_of)


def images_of(raw: dict[Any, Any]) -> dict[str, set[str]]:
    """The `tangram:images` hash decoded: CPU node -> the images it holds or can fetch."""
    out: dict[str, set[str]] = {}
    for node, value in raw.items():
        try:
            report = json.loads(value)
            refs = {str(r[0]) for r in report.get("held", [])} | {str(r) for r in report.get("fetchable", [])}
        except (ValueError, TypeError, AttributeError, IndexError):
            continue
        out[node.decode() if isinstance(node, bytes) else str(node)] = refs
    return out


def images() -> Call[dict[str, set[str]]]:
    """CPU node -> the images its worker reported it holds or can fetch."""
    return Call("read images", "hgetall", (IMAGES,), images_of)


def queued_count(tenant: str = DEFAULT) -> Call[int]:
    """Entries waiting in `tenant`'s intake."""
    return Call("queue length", "xlen", (intake_key(tenant),), int)


def _used_and_max(info: Any) -> tuple[int, int]:
    return int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))


def memory_use() -> Call[tuple[int, int]]:
    """(used, maxmemory) bytes of Redis memory (maxmemory 0: no ceiling), from INFO."""
    return Call("memory check", "info", ("memory",), _used_and_max)


def _published(raw: Any) -> tuple[int, int] | None:
    try:
        used, most = str(raw).split()
        return int(used), int(most)
    except (TypeError, ValueError):
        return None


def published_memory() -> Call[tuple[int, int] | None]:
    """(used, maxmemory) bytes as the scheduler last published them (`MEMORY`); None before it
    has (or unreadable)."""
    return Call("memory check", "get", (MEMORY,), lambda raw: None if raw is None else _published(raw))


# ---- waiting for results ------------------------------------------------------------------
def _popped(got: Any) -> str | None:
    return None if got is None else str(got[1])


def pop_result(action_id: str, timeout_s: float) -> Call[str | None]:
    """Wait up to `timeout_s` for the copy of the result that its completion pushes onto the
    action's own list (no notification list named): its JSON, or None."""
    return Call("wait for result", "blpop", ([nkey(action_id)],), _popped, {"timeout": max(timeout_s, 0.001)})


def pop_notified(notify: str, timeout_s: float) -> Call[str | None]:
    """Wait up to `timeout_s` for one result on an asyncio client's notification list."""
    return Call("result listener", "blpop", ([notify],), _popped, {"timeout": timeout_s})


def drain_notified(notify: str) -> Call[list[str]]:
    """Take what else waits on the notification list (up to `DRAIN_MAX` results)."""
    return Call("result listener", "lpop", (notify, DRAIN_MAX), lambda got: [str(x) for x in got or ()])


def forget_notified(notify: str) -> Call[None]:
    return Call("close", "delete", (notify,), _nothing)


def read_done(action_id: str) -> Call[None]:
    """Its caller has the result: keep it `READ_TTL_S` more instead of the day an unread one
    gets (`RESULT_TTL_S`, for a caller that died before reading)."""
    return Call("expire a read result", "expire", (akey(action_id), READ_TTL_S), _nothing)


# ---- control -------------------------------------------------------------------------------
def control(fields: dict[str, str], what: str = "control", tenant: str = DEFAULT) -> Call[None]:
    """A control message on `tenant`'s intake (sent again after a lost reply: a control applied
    twice changes nothing more). Its ids are the caller's own: the scheduler qualifies them
    with the tenant of the intake it came on."""
    return Call(what, "xadd", (intake_key(tenant), dict(fields.items())), _nothing)


def close_trajectory(trajectory_id: str, tenant: str = DEFAULT) -> Call[None]:
    """The trajectory is finished: its sandbox and memory go once its actions are done."""
    return control({"control": "close", "trajectory_id": trajectory_id}, "close trajectory", tenant)


def checked_notify(action_id: str, notify: str | None) -> str:
    """The list a completion of `action_id` (qualified) may wake: the notification list its hash
    names if that is its own tenant's (`keys.notify_prefix`), else the action's own list. A
    tenant writes its hashes itself: a list of another tenant's is never pushed onto."""
    if notify and notify.startswith(notify_prefix(tenant_of(action_id))):
        return notify
    if notify:
        log.warning("action %s names a notification list not of its tenant; ignored", action_id)
    return nkey(action_id)


def notify_of(action_id: str) -> Call[str | None]:
    """The notification list the hash of `action_id` (qualified) names (None: none)."""
    return Call("read notify", "hget", (akey(action_id), "notify"), _text)


def cancel_keys(action_id: str, tenant: str = DEFAULT, notify: str | None = None) -> list[str]:
    """The cancel script's keys for `tenant`'s `action_id` (its own id); `notify`: the
    notification list its hash names (`notify_of`)."""
    q = qualify(tenant, action_id)
    return [akey(q), nkey(q), intake_key(tenant), checked_notify(q, notify)]


def cancel_args(action_id: str, result_json: str) -> list[Any]:
    return [action_id, result_json, "", RESULT_TTL_S, GROUP]


def cancel(action_id: str, result_json: str, tenant: str = DEFAULT, notify: str | None = None) -> Call[str]:
    """Cancel an action that no scheduler has dispatched yet: 'cancelled' if it was, else its
    state ('dispatched', 'running', 'done', 'cancelled', or 'missing'), untouched. A second run
    after a lost reply finds it 'cancelled' already, which is the answer. The scheduler hears
    of it on `tenant`'s intake (a `cancel` control)."""
    keys = cancel_keys(action_id, tenant, notify)
    return Call(
        "cancel",
        "evalsha",
        (CANCEL_SHA, len(keys), *keys, *cancel_args(action_id, result_json)),
        str,
        script=CANCEL,
    )


# ---- submit --------------------------------------------------------------------------------
def ttl_arg(ttl_s: float) -> str:
    """The submit script's TTL argument: a payload not run within `ttl_s` expires (0: never)."""
    return str(int(ttl_s)) if ttl_s > 0 else "0"


class SubmitBatch:
    """The submit script's calls for a batch of (id, meta, payload) items, sent by digest
    (EVALSHA) in one round trip. (A pipeline of `Script` calls asks SCRIPT EXISTS first: a
    second round trip on every submit.) An item that met an empty script cache (a restarted
    Redis) did not run: `take` says so, and after a SCRIPT LOAD `pending` holds those items
    again, once; a second miss is left as the item's reply (an error for `check_submitted`).

    `notify`: the asyncio client's notification list ("" for the blocking client, whose
    waiters pop the action's own list). `tenant`: whose intake, keys and limits (the items'
    ids are its own)."""

    def __init__(
        self, items: Sequence[Item], max_queued: int, ttl: str, notify: str, tenant: str = DEFAULT
    ) -> None:
        intake, limits = intake_key(tenant), limits_key(tenant)
        self.calls = [
            Call(
                "submit",
                "evalsha",
                (
                    SUBMIT_SHA,
                    2,
                    intake,
                    akey(qualify(tenant, i)),
                    i,
                    meta,
                    payload,
                    max_queued,
                    ttl,
                    notify,
                    limits,
                ),
                lambda rep: rep,
                script=SUBMIT,
            )
            for i, meta, payload in items
        ]
        self.replies: list[Any] = [None] * len(self.calls)
        self._todo = list(range(len(self.calls)))
        self._rounds = 0

    def pending(self) -> list[Call[Any]]:
        """The calls of the items still to send."""
        return [self.calls[n] for n in self._todo]

    def take(self, replies: Sequence[Any]) -> bool:
        """Record the replies to `pending()` (errors as values); True when done, False to load
        the script (`SUBMIT`) and send `pending()` again."""
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


class MemoryCheck:
    """Whether Redis has room for more actions. When it has a `maxmemory` and uses more than
    the admitted fraction of it, nothing is enqueued (AdmissionError): the rest is headroom
    for results and scheduling, which must never be refused. Its memory use is read at most
    every `MEMORY_CHECK_S` (INFO is cheap but not free), and again at once after a refusal
    (it drains as actions finish)."""

    def __init__(self) -> None:
        self.used_max: tuple[int, int] = (0, 0)  # bytes, as last read
        self._read_s = float("-inf")

    def due(self, now_s: float) -> bool:
        """Whether to read the memory use (`memory_use()`) before `admit` (monotonic `now_s`)."""
        return now_s - self._read_s > MEMORY_CHECK_S

    def saw(self, used_max: tuple[int, int], now_s: float) -> None:
        self.used_max, self._read_s = used_max, now_s

    def admit(self, fraction: float, n: int) -> None:
        """AdmissionError when `n` actions may not be enqueued now."""
        why = memory_refusal(*self.used_max, fraction, n)
        if why is not None:
            self._read_s = float("-inf")
            raise AdmissionError(why)


def check_submitted(items: Sequence[Item], replies: Sequence[Any], max_queued: int) -> list[str]:
    """Raise for the first item the submit script refused (the ones before it were enqueued);
    else the ids of the items that were submitted before (same id and payload: a retry). Their
    results may exist already, so their waiters read first instead of waiting for a wake-up."""
    for n, ((action_id, _, _), rep) in enumerate(zip(items, replies, strict=True)):
        if isinstance(rep, redis.ResponseError):
            msg = str(rep)
            if "TANGRAM_FULL tenant" in msg:
                own = msg.rsplit(" ", 1)[-1]
                raise AdmissionError(
                    f"your tenant's intake is full ({own} actions waiting, its own max_queued "
                    f"set by the operator): the first {n} of this batch were enqueued, action "
                    f"{action_id} and the rest were not; retry them later"
                )
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
