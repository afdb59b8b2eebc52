"""Resizing a running action: the host half of core loans (`Sandbox.resize`).

A test suite given as test cases is malleable: the scheduler lends it spare cores while it runs
and takes them back when an allocation needs them (`scheduler.policies.malleable`). The CPU
worker keeps which cores each running action has (`tangram_celery.workers.loans`) and calls
`resize`; here the action's sandbox is re-bound (cpuset and CFS quota, at once) and its runner is
told the new DoP over its own socket (`tangram_runner/control.py`), so it starts more case
workers, or starts none until fewer run than the new count. A case running on a core taken away
finishes on the cores left.

Every binding of a sandbox that runs a resizable action (its start and each resize) happens under
one lock, so a resize never interleaves with the action's own binding: a resize that comes before
the action started is kept and is what the action starts with.

A time sharer (`ExecRequest.cpu_weight`, `scheduler.policies.time_share`) is bound to cores held
by another action; its sandbox's CPU weight is set with its binding, so that it never runs at the
default weight beside the holder, and restored when it leaves (the sandbox lives on for the
trajectory's next actions, which do not share).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from tangram_celery.sandbox.base import ExecRequest
from tangram_celery.sandbox.handle import Handle

log = logging.getLogger(__name__)

Bind = Callable[["Handle", tuple[int, ...], int], None]  # (sandbox, cores, memory_mb)
Call = Callable[["Handle", dict[str, Any]], dict[str, Any]]  # one request to the sandbox's runner
EARLY_TTL_S = 120.0  # a resize for an action that never starts here is forgotten after this
RETRY_S = 0.01
RETRY_FOR_S = 2.0  # the runner is between reading the action and running it, or just done


class Resizing:
    """The running actions of one sandbox pool that can be resized, by action id."""

    def __init__(self, bind: Bind, call: Call, clock: Callable[[], float] = time.monotonic) -> None:
        self._bind = bind
        self._call = call
        self._clock = clock
        self._lock = threading.Lock()
        self._running: dict[str, Handle] = {}
        self._early: dict[str, tuple[tuple[int, ...], float]] = {}  # action -> (cores, when)
        self._weighted: dict[int, Handle] = {}  # id of a sharer's request -> its sandbox

    def enter(self, h: Handle, req: ExecRequest) -> tuple[int, ...]:
        """Bind `h` for `req` and, if it names its action, make it resizable; returns its cores
        (those of a resize that came first, else the request's)."""
        aid = req.action_id
        with self._lock:
            early = self._early.pop(aid, None) if aid else None
            cores = early[0] if early is not None else tuple(req.cores)
            self._bind(h, cores, req.memory_mb)
            h.cores, h.memory_mb = cores, req.memory_mb
            if req.cpu_weight is not None and h.cgroups is not None:
                h.cgroups.set_cpu_weight(req.cpu_weight)
                self._weighted[id(req)] = h
            if aid:
                self._running[aid] = h
        return cores

    def set_memory(self, h: Handle, memory_mb: int) -> None:
        """Re-bind `h`'s memory limit alone (its compile phase gets more than its program)."""
        with self._lock:
            self._bind(h, h.cores, memory_mb)
            h.memory_mb = memory_mb

    def leave(self, req: ExecRequest) -> None:
        """The action ended: no resize reaches its sandbox any more, and a time sharer's
        sandbox has the default CPU weight again."""
        with self._lock:
            if req.action_id:
                self._running.pop(req.action_id, None)
            h = self._weighted.pop(id(req), None)
            if h is not None and h.cgroups is not None:
                try:
                    h.cgroups.set_cpu_weight(None)
                except OSError as e:  # torn down meanwhile (it died): nothing left to restore
                    log.debug("restoring the CPU weight of %s: %s", req.action_id, e)

    def resize(self, action_id: str, cores: tuple[int, ...]) -> bool:
        """See `Sandbox.resize`."""
        cores = tuple(sorted(set(cores)))
        if not cores:
            raise ValueError("an action keeps at least one core")
        with self._lock:
            h = self._running.get(action_id)
            if h is None:
                now = self._clock()
                self._early = {a: e for a, e in self._early.items() if now - e[1] < EARLY_TTL_S}
                self._early[action_id] = (cores, now)
                return False
            if cores != h.cores:
                self._bind(h, cores, h.memory_mb)
                h.cores = cores
        request = {"op": "dop", "key": action_id, "cores": list(cores)}
        deadline = self._clock() + RETRY_FOR_S
        while True:
            try:
                out = self._call(h, request)
            except Exception as e:  # the sandbox died or hung: the action's own exec reports it
                log.warning("resize of %s: runner unreachable (%s)", action_id, e)
                return False
            if out.get("applied"):
                return True
            with self._lock:
                if self._running.get(action_id) is not h:
                    return False  # it ended meanwhile
            if self._clock() > deadline:
                log.warning("resize of %s: its runner did not take DoP %d", action_id, len(cores))
                return False
            time.sleep(RETRY_S)
