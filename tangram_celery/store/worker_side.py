"""The workers' side of the store: claim an action exactly once, complete it or hand it back,
heart-beat, and report the sandboxes and GPU services they hold."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from enum import StrEnum
from typing import Any, NamedTuple

from tangram_celery.common import tenants
from tangram_celery.common.records import SandboxReport, WarmStatus
from tangram_celery.common.wire import (
    ActionMeta,
    AllocationWire,
    Chunk,
    Completion,
    DispatchRecord,
    GpuWarm,
    ResidencyReport,
    residency,
)
from tangram_celery.store.base import StoreBase
from tangram_celery.store.keys import (
    EVENTS,
    IMAGES,
    LANGS,
    RUNNING,
    SANDBOXES,
    WARM,
    WORKER_POOLS,
    WORKERS,
    akey,
)


class Claim(NamedTuple):
    """A granted claim: the action is this worker's to run now, as the attempt it claimed.

    `meta` is the scheduler's (its dispatch record's: qualified ids, `tenants.qualify`), and the
    payload carries the same ids: its action and trajectory ids are the record's, the ids of
    the trajectories it forks are qualified with its tenant. `notify`: the notification list
    its hash names ("" for none), for `complete`."""

    meta: ActionMeta
    payload: dict[str, Any]  # the action as its client stored it (`actions.stored_action`)
    dispatched_s: float
    notify: str = ""


class Refused(StrEnum):
    """Why a claim was not granted: the state the action is in, or one of three reasons."""

    STALE = "stale"  # dispatched again since, as a later attempt: this message is superseded
    # not what the scheduler recorded for the action (`tangram:running`): not the scheduler's
    # order (a forged or garbled message); refused before anything changed
    UNORDERED = "unordered"
    # granted, but its payload expired while it waited (limits.queued_ttl_s): the worker reports it
    EXPIRED = "expired"
    MISSING = "missing"  # no such action (its record expired)
    QUEUED = "queued"  # handed back or taken back: waiting to be placed again
    DISPATCHED = "dispatched"
    RUNNING = "running"  # claimed already, by another worker or attempt
    DONE = "done"
    CANCELLED = "cancelled"


def new_token() -> str:
    """A claim call's own token (`scripts.CLAIM`)."""
    return os.urandom(8).hex()


def _claimed(rep: Any) -> Claim | Refused:
    """The claim script's reply, typed."""
    if isinstance(rep, list):
        meta = DispatchRecord.model_validate_json(rep[4]).meta
        return Claim(meta, own_ids(json.loads(rep[1]), meta), float(rep[2] or 0.0), str(rep[3] or ""))
    return Refused(str(rep))


def own_ids(payload: dict[str, Any], meta: ActionMeta) -> dict[str, Any]:
    """The payload with the ids of the scheduler's record `meta` (qualified): its action and
    trajectory ids, and the trajectories it forks qualified with its tenant. A tenant writes
    its own hashes, so what it stored there is never taken for the ids the worker acts on."""
    payload["id"] = meta.id
    payload["trajectory_id"] = meta.trajectory_id or None
    forks = payload.get("fork_to")
    if forks:  # a caller's own ids (no `/`: none other can be submitted) in its tenant's names
        tenant = tenants.tenant_of(meta.id)
        payload["fork_to"] = [tenants.qualify(tenant, str(t)) for t in forks if tenants.SEP not in str(t)]
    return payload


def order_args(action_id: str, order: AllocationWire | None) -> list[str]:
    """The claim script's order arguments (`scripts.CLAIM`): what the scheduler's record must
    say. Without an order only the record's action and attempt are checked."""
    if order is None:
        return [action_id, "", "", "", "", RUNNING]
    ids = ",".join(str(u) for u in order.unit_ids)
    return [action_id, order.kind, order.pool, str(order.units), ids, RUNNING]


class WorkerSide(StoreBase):
    def claim(
        self,
        action_id: str,
        attempt: int,
        worker: str,
        now_s: float,
        token: str | None = None,
        order: AllocationWire | None = None,
    ) -> Claim | Refused:
        """dispatched -> running for `attempt`: the action's metadata and payload, or why not.

        Exactly once per call: the call's `token` (a fresh one by default) lets its own retries
        find their claim after a lost reply; another call, even of the same worker and attempt
        (a second delivery of the message), is refused as `running`. Only the scheduler's
        orders are claimed: `order` (the Celery message's) must be what its dispatch record
        says (`Refused.UNORDERED`)."""
        args = [worker, repr(now_s), str(attempt), token or new_token(), *order_args(action_id, order)]
        keys = [akey(action_id)]
        rep = self.retrying("claim", lambda: self._claim(keys=keys, args=args))
        return _claimed(rep)

    def claim_many(
        self,
        claims: Sequence[tuple[str, int]],
        worker: str,
        now_s: float,
        orders: Sequence[AllocationWire | None] | None = None,
    ) -> list[Claim | Refused]:
        """`claim` for each (action, attempt), in one round trip (the actions of a CPU batch,
        claimed when the batch starts so that none looks unclaimed while it waits its turn).
        Exactly once like `claim`: a retried pipeline finds its own claims (one token per call)."""
        token = new_token()
        each = list(orders) if orders is not None else [None] * len(claims)

        def run() -> list[Any]:
            pipe = self.r.pipeline(transaction=False)
            for (action_id, attempt), order in zip(claims, each, strict=True):
                args = [worker, repr(now_s), str(attempt), token, *order_args(action_id, order)]
                self._claim(keys=[akey(action_id)], args=args, client=pipe)
            return list(pipe.execute())

        return [_claimed(rep) for rep in self.retrying("claim", run)]

    def complete(
        self, action_id: str, result_json: str, event: Completion, notify: str | None = None
    ) -> bool:
        """Store the result, wake the client, emit the release event. False if already done.
        `notify`: the notification list its claim read (`Claim.notify`); None: read it now."""
        return self._finish(action_id, result_json, event, notify)

    def give_back(self, action_id: str, worker: str, attempt: int, event: Completion) -> bool:
        """Hand a running action back to the scheduler to place again (no result for the client).
        False if this worker's attempt no longer owns it."""
        ev = event.model_dump_json(exclude_none=True)
        return bool(
            self.retrying(
                "give_back",
                lambda: self._give_back(
                    keys=[akey(action_id), EVENTS], args=[worker, str(attempt), action_id, ev]
                ),
            )
        )

    def publish_residency(
        self,
        node: str,
        resident: dict[Chunk, list[str]],
        warm: GpuWarm | None = None,
        error: str = "",
        host_resident: dict[Chunk, list[str]] | None = None,
    ) -> None:
        """Tell the scheduler which services GPU `node` holds on which chunks, outside any
        action's completion (after a warm-up load, or a `warm` order it settles, with `error`
        when it failed), and which it keeps in host memory only (`host_resident`; None: the
        node has no host tier). It goes on the events stream, so it is ordered with the
        completions that carry the same maps."""
        host = residency(host_resident) if host_resident is not None else None
        report = ResidencyReport(
            pool=node, resident=residency(resident), host_resident=host, warm=warm, error=error[:500]
        )
        event = report.model_dump_json(exclude_none=True)
        self.retrying("residency", lambda: self.r.xadd(EVENTS, {"id": "", "event": event}))

    def set_warm_status(self, node: str, status: WarmStatus | None) -> None:
        """Record GPU `node`'s warm-up status; None forgets it (a new deployment starts)."""
        if status is None:
            self.retrying("warm status", lambda: self.r.hdel(WARM, node))
        else:
            self.retrying("warm status", lambda: self.r.hset(WARM, node, status.dump()))

    def set_languages(self, node: str, languages: Sequence[str]) -> None:
        """Record the languages CPU `node`'s sandboxes run (its toolchains), for clients to
        refuse actions in any other language at submit."""
        self.retrying("languages", lambda: self.r.hset(LANGS, node, json.dumps(list(languages))))

    def report_images(self, node: str, report: dict[str, Any]) -> None:
        """CPU `node`'s images (held, fetchable) and kept trajectory layers, for clients to
        refuse an unknown image at submit and for the scheduler to place by them."""
        self.retrying("images", lambda: self.r.hset(IMAGES, node, json.dumps(report)))

    def warm_status(self) -> dict[str, WarmStatus]:
        """GPU node -> its warm-up status (`state`: warming or done)."""
        return {str(k): WarmStatus.parse(v) for k, v in self.r.hgetall(WARM).items()}

    def heartbeat(self, worker: str, pool_key: str) -> None:
        self._heartbeat(keys=[WORKERS, WORKER_POOLS], args=[worker, pool_key])

    def report_sandboxes(self, worker: str, seq: int, held: Sequence[tuple[str, str]]) -> None:
        """A CPU worker's report of the sandboxes it holds, at its completion counter `seq`."""
        report = SandboxReport(seq=seq, held=tuple((t, g) for t, g in held))
        self.r.hset(SANDBOXES, worker, report.dump())
