"""The scheduler's side of the store: the intake and events streams, dispatch records, pins,
workers' heartbeats and sandbox reports, and taking actions back from lost workers."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

import redis
from pydantic import ValidationError

from tangram_celery.common.records import PinRecord, SandboxReport
from tangram_celery.common.tenants import DEFAULT
from tangram_celery.common.wire import Completion, DispatchRecord, EventStatus, PoolView
from tangram_celery.store.base import StoreBase
from tangram_celery.store.client_ops import CLIENT_SCRIPTS
from tangram_celery.store.keys import (
    CONFIG,
    CONSUMER,
    DEAD,
    DEAD_MAXLEN,
    EVENTS,
    GROUP,
    IMAGES,
    INTAKE,
    MEMORY,
    RESETS,
    RUNNING,
    SANDBOXES,
    TRAJ,
    WORKER_POOLS,
    WORKERS,
    IntakeEntry,
    akey,
    intake_key,
    split_ref,
)

log = logging.getLogger("tangram.store")

R = TypeVar("R", PinRecord, SandboxReport)


def _parsed(model: type[R], raw: dict[Any, Any], what: str) -> dict[str, R]:
    """The records of a hash, by field; one that does not parse (written by hand, or by an
    incompatible version) is logged and left out."""
    out: dict[str, R] = {}
    for k, v in raw.items():
        try:
            out[str(k)] = model.parse(v)
        except ValidationError as e:
            log.error("ignored the unreadable %s of %s: %s", what, k, e)
    return out


class SchedulerSide(StoreBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Writes `events_done` owes Redis: (command, arguments), sent with the next command
        # (`_owed_first`, `settle`).
        self._owed: list[tuple[str, tuple[Any, ...]]] = []
        # intake stream -> its tenant: the default tenant's and every registered tenant's
        # (`watch_tenants`); an entry's tenant is the stream it came on, never a field of it
        self.intakes: dict[str, str] = {INTAKE: DEFAULT}
        self._memory_published_s = float("-inf")

    def ensure_groups(self) -> None:
        for stream in (*self.intakes, EVENTS):
            self._group(stream)

    def _group(self, stream: str) -> None:
        try:
            self.r.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def watch_tenants(self, names: Iterable[str]) -> list[str]:
        """Read the intakes of the default tenant and of `names` (the registered tenants) from
        now on, and no other: a removed tenant's intake is no longer read. Returns the intake
        streams new to this call (their consumer group made, with the stream if need be)."""
        wanted = {INTAKE: DEFAULT} | {intake_key(t): t for t in sorted(names) if t != DEFAULT}
        new = [k for k in wanted if k not in self.intakes]
        for stream in new:
            self._group(stream)
        self.intakes = wanted
        return new

    def load_client_scripts(self) -> list[str]:
        """Load the scripts clients run (`client_ops.CLIENT_SCRIPTS`) that Redis's cache lacks
        (a restarted Redis): tenants' users may run them but not load them. The names loaded."""
        shas = list(CLIENT_SCRIPTS)
        there = self.r.script_exists(*shas)
        missing = [sha for sha, ok in zip(shas, there, strict=True) if not ok]
        for sha in missing:
            self.r.script_load(CLIENT_SCRIPTS[sha])
        return missing

    def publish_memory(self, every_s: float = 1.0) -> bool:
        """Publish Redis's memory use (`MEMORY`: "<used> <maxmemory>" bytes) for clients, whose
        users may not read INFO, at most every `every_s`; True when it did."""
        now = time.monotonic()
        if now - self._memory_published_s < every_s:
            return False
        self._memory_published_s = now
        used, most = self.memory_use()
        self.r.set(MEMORY, f"{used} {most}")
        return True

    def publish_config(self, view: PoolView) -> None:
        self.r.set(CONFIG, view.model_dump_json())

    def read(self, count: int, block_ms: int | None) -> tuple[list[IntakeEntry], list[IntakeEntry]]:
        """Read new intake (every tenant's, `intakes`) and events (one blocking call over all the
        streams), and write what `events_done` owes in the same round trip: after the read,
        whose answer comes with theirs (written first, their answers would wake the scheduler
        once more)."""
        streams: dict[Any, Any] = {EVENTS: ">"}
        streams.update((k, ">") for k in self.intakes)
        resp: Any
        try:
            if self._owed:
                pipe = self.r.pipeline(transaction=False)
                pipe.xreadgroup(GROUP, CONSUMER, streams, count=count, block=block_ms)
                resp = self._owed_first(pipe).execute()[0]
                self._owed.clear()
            else:
                resp = self.r.xreadgroup(GROUP, CONSUMER, streams, count=count, block=block_ms)
        except redis.ResponseError as e:  # a stream deleted by hand (its group with it)
            if "NOGROUP" not in str(e) and "key to exist" not in str(e):  # Redis, fakeredis
                raise
            log.warning("a stream lost its consumer group (%s); made again", e)
            self.ensure_groups()
            return [], []
        intake: list[IntakeEntry] = []
        events: list[IntakeEntry] = []
        for stream, entries in resp or []:
            if stream == EVENTS:
                events.extend(IntakeEntry(sid, fields) for sid, fields in entries)
            else:
                tenant = self.intakes.get(stream, DEFAULT)
                intake.extend(IntakeEntry(sid, fields, tenant) for sid, fields in entries)
        return intake, events

    def read_pending(self, stream: str, count: int = 10_000) -> Iterator[list[IntakeEntry]]:
        """This consumer's delivered but unacknowledged entries of `stream`, in order, in pages
        (an intake's entries carry its tenant)."""
        self.settle()
        after = "0"
        tenant = self.intakes.get(stream, DEFAULT)
        while True:
            resp: Any = self.r.xreadgroup(GROUP, CONSUMER, {stream: after}, count=count)
            entries = [IntakeEntry(sid, fields, tenant) for _, page in resp or [] for sid, fields in page]
            if not entries:
                return
            yield entries
            after = entries[-1].stream_id

    def ack(self, stream: str, ids: Iterable[str]) -> None:
        """Acknowledge and delete entries of `stream`; of the intakes (`stream` INTAKE), `ids`
        are entry references (`IntakeEntry.ref`), each acknowledged on its own tenant's intake."""
        by_stream = _by_stream(ids) if stream == INTAKE else {stream: list(ids)}
        by_stream = {k: v for k, v in by_stream.items() if v}
        if by_stream:
            pipe = self.r.pipeline(transaction=False)
            for key, sids in by_stream.items():
                pipe.xack(key, GROUP, *sids)
                pipe.xdel(key, *sids)
            pipe.execute()

    def load_running(self) -> dict[str, DispatchRecord]:
        """Every dispatched, unfinished action's record. A record that does not parse (written
        by hand, or by an incompatible version) is logged and left out."""
        self.settle()
        out: dict[str, DispatchRecord] = {}
        for k, v in self.r.hgetall(RUNNING).items():
            try:
                out[str(k)] = DispatchRecord.model_validate_json(v)
            except ValidationError as e:
                log.error("ignored the unreadable dispatch record of %s: %s", k, e)
        return out

    def load_pins(self) -> dict[str, PinRecord]:
        """Every pinned trajectory's record; an unreadable one is logged and left out (its
        trajectory starts over in a fresh sandbox)."""
        self.settle()
        return _parsed(PinRecord, self.r.hgetall(TRAJ), "pin record")

    def states(self, action_ids: Sequence[str]) -> list[str | None]:
        pipe = self.r.pipeline(transaction=False)
        for a in action_ids:
            pipe.hget(akey(a), "state")
        return list(pipe.execute())

    def mark_dispatched(
        self,
        records: Sequence[DispatchRecord],
        pins: dict[str, PinRecord],
        intake_ids: Sequence[str],
        now_s: float,
        *,
        forget_pins: Sequence[str] = (),
        resets: dict[str, float] | None = None,
        resets_done: Sequence[str] = (),
    ) -> list[str]:
        """Persist dispatch records and take their entries off the intakes (`intake_ids`: entry
        references, `IntakeEntry.ref`), in one atomic script.

        `pins` are pin records to write, `forget_pins` pins to delete (evicted trajectories),
        `resets` and `resets_done` trajectories to mark reset and to unmark (`update_pins`).
        Returns the ids it skipped because they are no longer queued (cancelled after the
        policy chose them): their messages must not be sent.

        This happens before the Celery messages are sent; a scheduler that dies in between
        re-sends every action still in state `dispatched` when it restarts (the worker's claim
        makes a duplicate message harmless).
        """
        streams = _by_stream(intake_ids)
        args: list[Any] = [GROUP, repr(now_s), len(records), len(streams)]
        for rec in records:
            args += [rec.alloc.action_id, rec.model_dump_json(exclude_none=True), rec.attempt]
        args.append(len(pins))
        for tid, pin in pins.items():
            args += [tid, pin.dump()]
        args.append(len(forget_pins))
        args += list(forget_pins)
        resets = resets or {}
        args.append(len(resets))
        for tid, at in resets.items():
            args += [tid, repr(at)]
        args.append(len(resets_done))
        args += list(resets_done)
        for sids in streams.values():
            args.append(len(sids))
            args += sids
        keys = [RUNNING, TRAJ, RESETS, *streams, *(akey(r.alloc.action_id) for r in records)]
        self.settle()  # first: a pin written by a completion, deleted here by an eviction
        return [str(a) for a in self._dispatch(keys=keys, args=args)]

    def dead_letter(self, stream_id: str, fields: dict[str, str], why: str) -> None:
        """Keep a malformed intake entry for inspection (`XRANGE tangram:dead - +`), bounded."""
        entry: dict[Any, Any] = dict(fields)
        entry.update(intake_id=stream_id, reason=why)
        self.r.xadd(DEAD, entry, maxlen=DEAD_MAXLEN, approximate=True)

    def events_done(
        self, finished: Sequence[str], pins: dict[str, PinRecord], event_ids: Sequence[str]
    ) -> None:
        """After a page of events: forget the finished actions' dispatch records, write the pin
        records whose owner changed, and take the events off the stream. Owed, not written at
        once: the writes go with the scheduler's next command, in the round trip of its next
        `read` (one per completion fewer) or before any other command (`settle`), in order.
        Nothing reads them meanwhile but this scheduler, which writes them before it does.
        All are idempotent, so a scheduler that dies before they reach Redis reads the events
        again (`read_pending`) and does the same."""
        if finished:
            self._owed.append(("hdel", (RUNNING, *finished)))
        for tid, pin in pins.items():
            self._owed.append(("hset", (TRAJ, tid, pin.dump())))
        if event_ids:
            self._owed.append(("xack", (EVENTS, GROUP, *event_ids)))
            self._owed.append(("xdel", (EVENTS, *event_ids)))

    def settle(self) -> None:
        """Write now what `events_done` owes (one round trip; nothing when it owes nothing).
        Kept owed when Redis fails: the next command writes it."""
        if self._owed:
            self._owed_first(self.r.pipeline(transaction=True)).execute()
            self._owed.clear()

    def _owed_first(self, pipe: Any) -> Any:
        for command, args in self._owed:
            getattr(pipe, command)(*args)
        return pipe

    def forget_running(self, action_ids: Sequence[str]) -> None:
        self.settle()
        if action_ids:
            self.r.hdel(RUNNING, *action_ids)

    def forget_pin(self, trajectory_id: str) -> None:
        self.settle()
        self.r.hdel(TRAJ, trajectory_id)

    def update_pins(
        self,
        pins: dict[str, PinRecord],
        forget: Sequence[str] = (),
        resets: dict[str, float] | None = None,
        resets_done: Sequence[str] = (),
    ) -> None:
        """Write and delete pin records, mark trajectories reset (their sandbox was lost) and
        unmark them, in one round trip."""
        if not (pins or forget or resets or resets_done):
            return
        pipe = self._owed_first(self.r.pipeline(transaction=True))
        for tid, pin in pins.items():
            pipe.hset(TRAJ, tid, pin.dump())
        if forget:
            pipe.hdel(TRAJ, *forget)
        if resets:
            pipe.hset(RESETS, mapping={t: repr(at) for t, at in resets.items()})
        if resets_done:
            pipe.hdel(RESETS, *resets_done)
        pipe.execute()
        self._owed.clear()

    def load_resets(self) -> dict[str, float]:
        return {str(k): float(v) for k, v in self.r.hgetall(RESETS).items()}

    def sandbox_reports(self) -> dict[str, SandboxReport]:
        """Each CPU worker's report of the sandboxes it holds (an unreadable one left out)."""
        return _parsed(SandboxReport, self.r.hgetall(SANDBOXES), "sandbox report")

    def image_reports(self) -> dict[str, dict[str, Any]]:
        """Each CPU node's image report (`IMAGES`: held, fetchable, layers); an unreadable one
        is logged and left out, a node with none is absent."""
        out: dict[str, dict[str, Any]] = {}
        for node, raw in self.r.hgetall(IMAGES).items():
            try:
                report = json.loads(raw)
            except ValueError as e:
                log.error("ignored the unreadable image report of %s: %s", node, e)
                continue
            if isinstance(report, dict):
                out[node.decode() if isinstance(node, bytes) else str(node)] = report
        return out

    def workers(self) -> tuple[float, dict[str, tuple[float, str]]]:
        """(Redis server time, {worker: (last heartbeat, pool key)})."""
        pipe = self.r.pipeline(transaction=False)
        pipe.time()
        pipe.hgetall(WORKERS)
        pipe.hgetall(WORKER_POOLS)
        (sec, usec), beats, pools = pipe.execute()
        now = float(sec) + float(usec) / 1e6
        return now, {str(w): (float(t), str(pools.get(w, ""))) for w, t in beats.items()}

    def forget_worker(self, worker: str) -> None:
        self.r.hdel(WORKERS, worker)
        self.r.hdel(WORKER_POOLS, worker)
        self.r.hdel(SANDBOXES, worker)

    def owners(self, action_ids: Sequence[str]) -> list[tuple[str | None, str | None, int, float]]:
        """(state, worker, attempt, dispatched_s) of each action."""
        pipe = self.r.pipeline(transaction=False)
        for a in action_ids:
            pipe.hmget(akey(a), "state", "worker", "attempt", "dispatched_s")
        return [(s, w, int(n or 0), float(d or 0.0)) for s, w, n, d in pipe.execute()]

    def requeue(self, action_id: str, worker: str, to_state: str, attempt: int, now_s: float) -> bool:
        """Take an action back from a worker presumed dead (or a pool that is gone). Sent again
        (`dispatched`), its dispatch record names the new attempt, which its worker's claim
        checks (`scripts.CLAIM`)."""
        record = ""
        if to_state == "dispatched":
            raw = self.r.hget(RUNNING, action_id)
            if raw is not None:
                try:
                    rec = DispatchRecord.model_validate_json(raw)
                    record = rec.model_copy(update={"attempt": attempt}).model_dump_json(exclude_none=True)
                except ValidationError as e:
                    log.error("dispatch record of %s unreadable, left as it was: %s", action_id, e)
        args = [worker, to_state, str(attempt), repr(now_s), action_id, record]
        return bool(self._requeue(keys=[akey(action_id), RUNNING], args=args))

    def finish_unrun(self, action_id: str, result_json: str, trajectory_id: str) -> None:
        """Final result for an action the scheduler refused or gave up on (no worker ran it)."""
        self._finish(
            action_id, result_json, Completion(status=EventStatus.UNRUN, trajectory_id=trajectory_id)
        )


def _by_stream(refs: Iterable[str]) -> dict[str, list[str]]:
    """Intake entry references (`IntakeEntry.ref`) by the intake stream they are on."""
    out: dict[str, list[str]] = {}
    for ref in refs:
        stream, sid = split_ref(ref)
        out.setdefault(stream, []).append(sid)
    return out
