"""Backpressure: every HTTP action runs under a deadline it can keep, or is withdrawn unrun.

A request arriving at `t0` is answered by `t0 + wait + slack_s`, where `wait` is the time the
caller's own timeouts grant it (a SandboxFusion call: compile + run timeout, whatever the
language; verl's client waits that plus 10 s) and at least `budget`, the longest the action may
run once started (its own time limits). The action must therefore start by
`t0 + wait + slack_s - budget - exec_margin_s`; if it has not, it is cancelled in the store
(which succeeds only while no scheduler has dispatched it) and the caller gets the overload
status (504 by default, which verl's client retries). An interpreted program has no compile
phase, so its compile timeout is queueing time. If the cancel loses the race, the action has started: the request
waits for its result up to the deadline. So a caller told "overloaded" can rely on the action
never running, and no request waits past its deadline. The one exception is an action that
overruns its own limits by more than `exec_margin_s` (its worker died mid-action, the host
stalled): at the deadline the caller gets an error naming the action, which may still finish.

A full intake (`scheduler.max_queued`) or more than `max_in_flight` requests at once get the
overload status at once, with nothing enqueued.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from tangram_celery.client.aio import AsyncTangramClient
from tangram_celery.common.admission import AnyAction
from tangram_celery.common.config import HttpConfig
from tangram_celery.common.errors import AdmissionError, ResultTimeout
from tangram_celery.common.wire import ActionResult

log = logging.getLogger("tangram.web")


@dataclass(frozen=True)
class Overloaded:
    """The action was not run (intake full, too many requests, or it could not start in time)."""

    reason: str
    action_id: str | None = None


@dataclass(frozen=True)
class Late:
    """The action started but had no result by the deadline (it overran its own limits)."""

    action_id: str
    deadline_s: float


Outcome = ActionResult | Overloaded | Late


class Gate:
    """Admission and deadlines for the HTTP server's actions (one per server)."""

    def __init__(self, client: AsyncTangramClient, cfg: HttpConfig) -> None:
        self.client = client
        self.cfg = cfg
        self.in_flight = 0
        self.overloaded_total = 0
        self._background: set[asyncio.Task[Any]] = set()

    def admit(self) -> bool:
        """Take an in-flight slot (call `leave` after); False when all are taken."""
        if self.in_flight >= self.cfg.max_in_flight:
            self.overloaded_total += 1
            return False
        self.in_flight += 1
        return True

    def leave(self) -> None:
        self.in_flight -= 1

    def background(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` after the response (kept referenced until it ends; errors logged)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background call failed: %s", task.exception())

    def deadline(self, t0: float, budget_s: float, wait_s: float | None = None) -> float:
        """When a request that arrived at monotonic `t0` must be answered."""
        return t0 + max(budget_s, wait_s or 0.0) + self.cfg.slack_s

    async def run(
        self, action: AnyAction, *, t0: float, budget_s: float, wait_s: float | None = None
    ) -> Outcome:
        """Submit `action` and wait for it within the deadline (see the module docstring):
        `budget_s` is the longest it may run once started, `wait_s` the time the caller's
        timeouts grant the request (default: `budget_s`)."""
        deadline = self.deadline(t0, budget_s, wait_s)
        latest_start = deadline - budget_s - self.cfg.exec_margin_s
        try:
            handle = await self.client.submit(action)
        except AdmissionError as e:
            self.overloaded_total += 1
            return Overloaded(f"intake full: {e}")
        try:
            return await self.client.result(handle.id, timeout=max(0.0, latest_start - time.monotonic()))
        except ResultTimeout:
            pass
        waited = time.monotonic() - t0
        if await self.client.cancel(handle.id, f"not started within {waited:.1f} s (HTTP deadline)"):
            self.overloaded_total += 1
            return Overloaded(f"the action could not start within {waited:.1f} s", handle.id)
        try:  # it started (or finished) meanwhile: its own limits end it before the deadline
            return await self.client.result(handle.id, timeout=max(0.0, deadline - time.monotonic()))
        except ResultTimeout:
            return Late(handle.id, deadline - t0)

    async def run_one_shot(
        self,
        make: Callable[[str | None], AnyAction],
        *,
        t0: float,
        budget_s: float,
        wait_s: float | None = None,
    ) -> Outcome:
        """An action of no trajectory: a one-shot action (`make(None)`), run in a ready sandbox
        of its own that is released, with its memory, when it completes; nothing to close."""
        return await self.run(make(None), t0=t0, budget_s=budget_s, wait_s=wait_s)
