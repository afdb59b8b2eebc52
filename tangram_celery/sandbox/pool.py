"""Allocate-on-execution, shared by both backends: one warm sandbox per trajectory.

A trajectory's sandbox (container or bubblewrap namespace) is taken on its first action from a
small pool of ready sandboxes (`sandbox.prewarm`, refilled in the background: `ReadyPool`), or
started then if none is ready, with a resident runner as PID 1; it lives until
`close_trajectory` (the scheduler's close, eviction or idle TTL) or `idle_ttl_s` without
actions. Before each exec the action's cores and memory are bound (cpuset + CFS quota, memory
limit), which is also how a ready sandbox is handed out; after it the runner has killed every
process of the action, so the cores are free again. A one-shot action (`run_once`) takes a
ready sandbox and gives it up afterwards. A sandbox given up (one-shot done, trajectory closed or
evicted) is scrubbed and returned to the ready pool (`_recycle`; docs/sandbox.md "Recycling"),
or destroyed when it cannot be scrubbed or looks tampered with. Backends only say how to start, bind and destroy a
sandbox; the exec path, the limits and the statuses live here.

The scheduler names each trajectory sandbox's generation (`ExecRequest.sandbox_gen`): a
sandbox of an older generation is replaced, and an action that expected a sandbox and finds
none (lost with a restarted worker) or a dead one gets a fresh one with `sandbox_reset` set.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from tangram_celery.common.actions import ActionStatus
from tangram_celery.common.config import SandboxConfig
from tangram_celery.common.errors import SandboxError
from tangram_celery.sandbox.base import ExecRequest, ExecResult
from tangram_celery.sandbox.handle import Handle
from tangram_celery.sandbox.limits import (
    RUNNER_GRACE_S,
    TOOLS_PATH,
    Limits,
    classify,
    counter_delta,
    runner_timeout_s,
    to_result,
)
from tangram_celery.sandbox.link import RunnerGone, RunnerTimeout, RunnerUnreachable, call_runner
from tangram_celery.sandbox.prewarm import BACKGROUND_DELAY_S, Disposer, ReadyPool
from tangram_celery.sandbox.resize import Resizing
from tangram_celery.sandbox.runner_request import runner_request
from tangram_celery.sandbox.stage import SandboxScope, Stage
from tangram_runner.protocol import Facts, RunRequest

log = logging.getLogger(__name__)
START_TIMEOUT_S = 20.0
SCRUB_TIMEOUT_S = 20.0


class WarmPool(ABC):
    """The Sandbox implementation; subclasses provide `_start`, `_destroy`, `_alive`."""

    name = "abstract"

    def __init__(
        self, cfg: SandboxConfig, limits: Limits | None = None, scope: SandboxScope | None = None
    ) -> None:
        self.cfg = cfg
        self.limits = limits or Limits.from_config(cfg)
        self.who = scope or SandboxScope()  # a private scope unless the worker names its node
        self.owner = self.who.incarnation
        self.stage = Stage(cfg.stage_dir, self.who)
        self.state_root = self.stage.sandboxes
        self.tools_dir = self.stage.stage_tools()
        self.pythonpath = [TOOLS_PATH] if self.tools_dir is not None else []
        self._sweep_previous()  # before serving: the previous incarnation's sandboxes go
        self._handles: dict[str, Handle] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Handed-out sandboxes that are done (one-shot, closed, evicted) are destroyed here, off
        # the action's critical path.
        self._recycling = cfg.recycle and cfg.prewarm > 0
        self._disposer: Disposer[Handle] = Disposer(self._retire)
        self._prewarm_cores = tuple(sorted(os.sched_getaffinity(0)))
        # where the next ready sandbox starts: the cores the last taker asked for (a new
        # trajectory will likely run where the last one did), one core in turn before any did
        self._taken_cores: tuple[int, ...] | None = None
        self._started = 0
        self.ready = ReadyPool(
            cfg.prewarm,
            self._start_ready,
            self._destroy_ready,
            self._alive,
            keep=cfg.ready_max,
            starved=self._disposer.hurry,
            reserve=cfg.ready_idle or 0,
            quiet_s=self._quiet_s,
            held=lambda: len(self._handles),  # no lock: `_prime` asks the pool under ours
        )
        # running actions a core loan can resize (`resize`)
        self._resizing = Resizing(self._bind, lambda h, req: call_runner(h.socket_path, req, 5.0))
        self._running = 0  # actions executing now (`_prime` warms verifiers only when none is)
        self._idle_since = time.monotonic()  # when the last action ended (the pool grows after)
        self._reaper = threading.Thread(target=self._reap_loop, name="sandbox-reaper", daemon=True)
        self._reaper.start()

    # -- backend hooks ---------------------------------------------------------------------------
    @abstractmethod
    def _start(self, h: Handle) -> None:
        """Create the sandbox with its runner; set `h.ref` and, if readable, `h.cgroups`."""

    @abstractmethod
    def _destroy(self, h: Handle) -> None:
        """Remove the sandbox and everything in it (must not raise)."""

    @abstractmethod
    def _alive(self, h: Handle) -> bool: ...

    def _sweep_previous(self) -> None:
        """Remove what dead incarnations of this scope left; backends first remove their
        sandboxes (cgroups, containers), then call this for the directories."""
        for inc in self.stage.stale_incarnations():
            self.stage.remove_incarnation(inc)

    def _bind(self, h: Handle, cores: tuple[int, ...], memory_mb: int) -> None:
        """Bind cores and memory; the default writes cgroups, Docker falls back to `update`."""
        if h.cgroups is None:
            return
        if cores != h.cores:
            h.cgroups.bind_cores(cores, was=h.cores)
        if memory_mb != h.memory_mb:
            h.cgroups.set_memory(memory_mb)

    # -- Sandbox protocol ------------------------------------------------------------------------
    def run(self, trajectory_id: str, request: ExecRequest) -> ExecResult:
        """Run `request` in the trajectory's warm sandbox, bound to `request.cores`."""
        h, reset = self._acquire(trajectory_id, request)
        try:
            try:
                res = self._exec(h, request, retry=True)
            except RunnerUnreachable as e:
                # It died before the action reached it (the liveness check just before could
                # not see it yet): nothing ran, so the action runs in another sandbox, as it
                # would have a moment later. The trajectory lost its files if it had used it.
                log.warning(
                    "sandbox of %s died before its action reached it (%s); another one runs it",
                    trajectory_id,
                    e,
                )
                reset = reset or h.used
                self._refill(h, request)
                res = self._exec(h, request)
        finally:
            self._resizing.leave(request)
            h.last_used_s = time.monotonic()
            h.lock.release()
        if reset:
            res.sandbox_reset = True
        return res

    def run_once(self, request: ExecRequest) -> ExecResult:
        """Run `request` in a sandbox of its own (a ready one if any), discarded afterwards."""
        h = self._one_shot(request)
        try:
            try:
                return self._exec(h, request, retry=True)
            except RunnerUnreachable as e:  # died before the action reached it: nothing ran
                log.warning(
                    "a one-shot sandbox died before its action reached it (%s); another one runs it", e
                )
                self._teardown(h)
                h = self._one_shot(request)
                return self._exec(h, request)
        finally:
            self._resizing.leave(request)
            self._dispose(h)

    def _one_shot(self, request: ExecRequest) -> Handle:
        """A sandbox for a one-shot action: a ready one if any, else one started now."""
        h = self.ready.take(self._bound_for(request))
        if h is None:
            h = self._new_handle("one-shot", request.memory_mb, tuple(request.cores))
            h.trajectory_id = f"one-shot-{h.state_dir.name}"  # unique: Docker names containers by it
            try:
                self._start_and_wait(h)
            except BaseException:
                self._teardown(h)
                raise
        return h

    def close_trajectory(self, trajectory_id: str, generation: str | None = None) -> None:
        """Remove the trajectory's sandbox (in the background); with `generation`, only if it
        is that one: a sandbox of a newer generation, started since, is kept."""
        with self._lock:
            h = self._handles.get(trajectory_id)
            if h is None or (generation and h.gen and h.gen != generation):
                return
            del self._handles[trajectory_id]
        self._dispose(h)

    def resize(self, action_id: str, cores: tuple[int, ...]) -> bool:
        """Re-bind a running action's sandbox to `cores` and tell its runner the new DoP
        (`tangram_celery.sandbox.resize`)."""
        return self._resizing.resize(action_id, cores)

    def start_prewarm(self) -> None:
        """Start keeping `sandbox.prewarm` sandboxes ready (once the backend is set up)."""
        self.ready.start()

    def held(self) -> list[tuple[str, str]]:
        """(trajectory, generation) of every live trajectory sandbox."""
        with self._lock:
            return [(t, h.gen) for t, h in self._handles.items() if h.ref is not None]

    def close(self) -> None:
        self._stop.set()
        self.ready.close()
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
        self._disposer.close()
        for h in handles:
            self._teardown(h)
        self.stage.close()

    def trajectories(self) -> list[str]:
        with self._lock:
            return list(self._handles)

    # -- internals -------------------------------------------------------------------------------
    def _new_handle(self, tid: str, memory_mb: int, cores: tuple[int, ...]) -> Handle:
        d = self.state_root / uuid.uuid4().hex[:12]
        d.mkdir(mode=0o700)
        return Handle(tid, d, memory_mb, cores)

    def _start_and_wait(self, h: Handle, prime: bool = False) -> None:
        t0 = time.monotonic()
        self._start(h)
        self._wait_ready(h, prime)
        log.debug("%s sandbox %s ready in %.3f s", self.name, h.trajectory_id, time.monotonic() - t0)

    def _start_ready(self) -> Handle:
        """A started sandbox for the ready pool, with the default memory limit and a verifier
        waiting in it, bound to the cores the last taker asked for (before any did, to one of
        the worker's cores in turn): an action on those cores takes it as it is (`_bound_for`),
        any other one binds its own at hand-out. Its warm-up ran on the cores it is bound to,
        whose caches then hold it."""
        cores = self._taken_cores or (self._prewarm_cores[self._started % len(self._prewarm_cores)],)
        h = self._new_handle("ready", self.cfg.default_memory_mb, cores)
        self._started += 1
        h.trajectory_id = f"ready-{h.state_dir.name}"
        try:
            self._start_and_wait(h, prime=True)
        except BaseException:
            self._teardown(h)
            raise
        return h

    def _destroy_ready(self, h: Handle) -> None:
        self._teardown(h)

    def _dispose(self, h: Handle) -> None:
        """Recycle or destroy a sandbox no action of its occupant will use again, in the
        background."""
        delay_s = None
        if self._recycling:
            self.ready.expect()
            # at once while the pool is short (the next new trajectory may need this one); a
            # little later when it is full, off the cores of the action that caused it
            delay_s = 0.0 if len(self.ready) < self.ready.size else BACKGROUND_DELAY_S
        self._disposer.put(h, delay_s)

    def _teardown_locked(self, h: Handle) -> None:
        with h.lock:  # waits for an action still running in it, if any
            self._teardown(h)

    def _retire(self, h: Handle) -> None:
        """A sandbox no action of its occupant will use again: scrubbed into the ready pool when
        recycling is on and it is healthy, destroyed otherwise."""
        try:
            self._retire_locked(h)
        finally:
            if self._recycling:
                self.ready.settled()

    def _retire_locked(self, h: Handle) -> None:
        with h.lock:  # waits for an action still running in it, if any
            if self._recycling and not self._stop.is_set() and self._alive(h):
                try:
                    fresh = self._recycle(h)
                except Exception as e:  # any failure: destroy, never reuse
                    log.warning("sandbox %s not recycled: %s", h.trajectory_id, e)
                    fresh = None
                if fresh is not None and self.ready.recycle(fresh):
                    h.ref, h.cgroups, h.link = None, None, None  # now owned by `fresh`
                    return
                if fresh is not None:
                    h.ref, h.cgroups = fresh.ref, fresh.cgroups
            self._teardown(h)

    def _recycle(self, h: Handle) -> Handle | None:
        """Scrub the sandbox for another occupant; a new handle for it, or None when the scrub
        failed or anything looks tampered with (the caller destroys it then)."""
        t0 = time.monotonic()
        facts = h.call({"op": "scrub", **self._prime()}, SCRUB_TIMEOUT_S)
        if not facts.get("scrubbed") or facts.get("pid") != 1:
            log.warning("sandbox %s: scrub incomplete (%s); destroyed", h.trajectory_id, facts)
            return None
        problem = self._tampered(h)
        if problem:
            log.warning("sandbox %s looks tampered with (%s); destroyed", h.trajectory_id, problem)
            return None
        # It keeps its cores and memory limit: the next occupant's action binds its own, and a
        # taker on the same cores (`take(prefer=...)`) then writes no cgroup file at all.
        fresh = Handle(
            f"ready-{h.state_dir.name}", h.state_dir, h.memory_mb, h.cores, h.ref, h.cgroups, link=h.link
        )
        log.debug("sandbox %s scrubbed in %.3f s", h.trajectory_id, time.monotonic() - t0)
        return fresh

    def _prime(self) -> dict[str, Any]:
        """What the runner needs to start a verifier like the ones actions will ask for, in a
        ready sandbox (`prime` in a ping or a scrub); nothing in the rlimit fallback, where a
        verifier's limits follow each action's memory and cores. The verifier warms itself up
        only while no action runs on this worker and `prewarm` sandboxes are ready: a warm-up
        takes the first job's copy-on-write faults off that job's path but costs more CPU in
        all than it saves (a test of its own through a thread), so it is worth doing only on
        cores that would idle otherwise; when actions run or the pool is short (new
        trajectories arrive faster than it refills), the cores are better spent on actions."""
        if self.limits.use_rlimits:
            return {}
        with self._lock:
            idle = self._running == 0
        warm = idle and len(self.ready) >= self.ready.size
        return {"prime": {"nofile": self.limits.nofile, "pythonpath": self.pythonpath, "warm_verifier": warm}}

    def _quiet_s(self) -> float:
        """Seconds since the last action ended, 0 while one runs (`ReadyPool` grows meanwhile)."""
        with self._lock:
            return 0.0 if self._running else time.monotonic() - self._idle_since

    def _tampered(self, h: Handle) -> str:
        """What, seen from outside, rules out reusing a scrubbed sandbox ("" when nothing): the
        backend's check (namespace: its cgroup's processes)."""
        return ""

    def _acquire(self, tid: str, req: ExecRequest) -> tuple[Handle, bool]:
        """The trajectory's handle, locked, with a live sandbox (a ready one handed out, or one
        started now); and whether that is a reset (see the module doc)."""
        while True:
            with self._lock:
                h = self._handles.get(tid)
            found = h is not None
            if h is None:  # a new trajectory (or one whose sandbox is gone): a ready sandbox
                new = self.ready.take(self._bound_for(req)) or self._new_handle(
                    tid, req.memory_mb, tuple(req.cores)
                )
                new.trajectory_id, new.gen = tid, req.sandbox_gen
                new.last_used_s = time.monotonic()  # not reaped before its first action
                with self._lock:
                    h = self._handles.get(tid)
                    if h is None:
                        h = self._handles[tid] = new
                if h is not new:  # another action of the trajectory got there first
                    found = True
                    if new.ref is not None:
                        self.ready.give_back(new)
                    else:
                        shutil.rmtree(new.state_dir, ignore_errors=True)
            h.lock.acquire()
            with self._lock:
                if self._handles.get(tid) is h:
                    break
            h.lock.release()  # reaped or closed meanwhile: take the new one
        expected = bool(req.sandbox_gen) and not req.new_sandbox  # the scheduler expects one
        reset = False
        if not found:
            reset = expected  # none here although the trajectory had one (e.g. a worker restart)
        elif req.sandbox_gen and h.gen != req.sandbox_gen:
            # A sandbox of another generation: stale (its close has not arrived yet) or not the
            # one the scheduler expects. Never run in it.
            if h.ref is not None:
                self._teardown_in_place(h)
            h.gen = req.sandbox_gen
            reset = expected
        elif h.ref is not None and not self._alive(h):
            log.warning("sandbox of %s died; starting a fresh one", tid)
            self._teardown_in_place(h)
            reset = True
        if h.ref is not None and self._alive(h):
            return h, reset
        try:
            self._refill(h, req)
        except BaseException:
            h.lock.release()
            raise
        return h, reset

    def _refill(self, h: Handle, req: ExecRequest) -> None:
        """Give the locked handle `h`, whose sandbox is gone or dead, a live one: a ready one,
        or one started now. On failure the handle is forgotten (the trajectory's next action
        starts from nothing) and the error raised; the caller still holds `h.lock`."""
        try:
            if h.ref is not None:  # a sandbox that died while it waited
                self._teardown_in_place(h)
            ready = self.ready.take(self._bound_for(req))
            if ready is not None:
                self._adopt(h, ready)
            else:
                h.memory_mb, h.cores, h.used = req.memory_mb, tuple(req.cores), False
                self._start_and_wait(h)
                log.info("%s sandbox for %s started (none ready)", self.name, h.trajectory_id)
        except BaseException:
            h.drop_link()
            self._destroy(h)
            h.ref = None
            with self._lock:
                if self._handles.get(h.trajectory_id) is h:
                    del self._handles[h.trajectory_id]
            raise

    def _bound_for(self, req: ExecRequest) -> Callable[[Handle], bool]:
        """Whether a ready sandbox is bound to `req`'s cores already (handing it out then
        rewrites no cpuset or quota); also where the next ready sandbox will start."""
        cores = tuple(req.cores)
        if set(cores) <= set(self._prewarm_cores):
            self._taken_cores = cores
        return lambda h: h.cores == cores

    def _adopt(self, h: Handle, ready: Handle) -> None:
        """Move a ready sandbox into `h` (whose own is gone)."""
        old_dir = h.state_dir
        h.drop_link()
        h.state_dir, h.ref, h.cgroups, h.link = ready.state_dir, ready.ref, ready.cgroups, ready.link
        h.memory_mb, h.cores, h.used = ready.memory_mb, ready.cores, False
        if old_dir != h.state_dir:
            shutil.rmtree(old_dir, ignore_errors=True)

    def _wait_ready(self, h: Handle, prime: bool = False) -> None:
        """Until the runner answers; with `prime` (a ready sandbox), it first starts a verifier
        and runs one test of its own through it (`runner._prime`)."""
        ping = {"op": "ping", **(self._prime() if prime else {})}
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if h.socket_path.exists():
                try:
                    if h.call(ping, max(5.0, deadline - time.monotonic())).get("pong"):
                        return
                except (RunnerGone, RunnerTimeout):
                    pass
            if not self._alive(h):
                raise SandboxError(f"{self.name} sandbox exited during start: {self._logs(h)}")
            time.sleep(0.005)
        raise SandboxError(f"{self.name} sandbox runner not ready in {START_TIMEOUT_S} s")

    def _logs(self, h: Handle) -> str:
        return ""

    def _exec(self, h: Handle, req: ExecRequest, retry: bool = False) -> ExecResult:
        """Run `req` in `h`'s sandbox. With `retry`, a sandbox found dead before the request
        reached it is torn down and `RunnerUnreachable` raised (the caller runs it in another);
        otherwise that is reported as any lost runner is."""
        cores = self._resizing.enter(h, req)  # bound: the request's cores, or a loan's since
        request = runner_request(req, self.limits, self.pythonpath, self.cfg.compile_memory_mb)
        request = request._replace(cores=list(cores))
        before = h.cgroups.counters() if h.cgroups else None
        t0 = time.monotonic()
        with self._lock:
            self._running += 1
        try:
            if request.compile_memory_mb > req.memory_mb:
                facts = self._phases(h, req, request)
            else:
                facts = Facts.from_dict(h.call(request.to_dict(), runner_timeout_s(req)))
        except (RunnerGone, RunnerTimeout) as e:
            if retry and isinstance(e, RunnerUnreachable):
                self._teardown_in_place(h)
                raise
            h.used = True
            after = h.cgroups.counters() if h.cgroups else None
            delta = counter_delta(before, after)
            self._teardown_in_place(h)
            status = ActionStatus.TIMEOUT if isinstance(e, RunnerTimeout) else ActionStatus.ERROR
            if delta.get("oom_kill", 0) > 0:
                status = ActionStatus.MEMORY_LIMIT
            detail = f"sandbox runner lost ({e}); the trajectory's sandbox was reset"
            log.warning("%s: %s", h.trajectory_id, detail)
            return ExecResult(status=status, exec_s=time.monotonic() - t0, detail=detail, sandbox_reset=True)
        finally:
            with self._lock:
                self._running -= 1
                self._idle_since = time.monotonic()
        h.used = True
        if facts.runner_error is not None:
            return ExecResult(
                status=ActionStatus.ERROR, detail=str(facts.runner_error), exec_s=time.monotonic() - t0
            )
        after = h.cgroups.counters() if h.cgroups else None
        return to_result(facts, counter_delta(before, after), req)

    def _phases(self, h: Handle, req: ExecRequest, request: RunRequest) -> Facts:
        """Compile under the compile phase's memory, then run under the action's own: two
        requests, the sandbox's limit lowered in between (no user code runs then). The facts
        of a compile that did not succeed are the action's; else the run's, with the compile's."""
        room = request.compile_memory_mb
        first_req = request._replace(phase="compile", fetch_files=[])
        if request.rlimits is not None:
            first_req = first_req._replace(rlimits={**request.rlimits, "AS": room << 20})
        self._resizing.set_memory(h, room)
        try:
            first = Facts.from_dict(h.call(first_req.to_dict(), req.compile_timeout_s + RUNNER_GRACE_S))
        except BaseException:
            with contextlib.suppress(Exception):  # (the sandbox is torn down for this anyway)
                self._resizing.set_memory(h, req.memory_mb)
            raise
        try:
            self._resizing.set_memory(h, req.memory_mb)
        except Exception as e:  # the program must not run with the compiler's room
            raise RunnerGone(f"could not restore the memory limit after the compile: {e}") from e
        if first.runner_error is not None or classify(first, {}, False) is not ActionStatus.OK:
            return first
        facts = Facts.from_dict(
            h.call(request._replace(phase="run").to_dict(), req.timeout_s + RUNNER_GRACE_S)
        )
        if facts.runner_error is None:
            facts = facts._replace(compile=first.compile, exec_s=float(first.exec_s) + float(facts.exec_s))
        return facts

    def _teardown_in_place(self, h: Handle) -> None:
        """Destroy a broken sandbox but keep the handle: the next action starts a fresh one."""
        h.drop_link()
        self._destroy(h)
        h.ref = None
        h.cgroups = None

    def _teardown(self, h: Handle) -> None:
        h.drop_link()
        self._destroy(h)
        h.ref = None
        shutil.rmtree(h.state_dir, ignore_errors=True)

    def _reap_loop(self) -> None:
        """Remove sandboxes idle for longer than `idle_ttl_s`."""
        period_s = max(0.05, min(self.cfg.idle_ttl_s / 4, 5.0))
        while not self._stop.wait(period_s):
            now = time.monotonic()
            with self._lock:
                idle = [
                    h
                    for h in self._handles.values()
                    if now - h.last_used_s > self.cfg.idle_ttl_s and not h.lock.locked()
                ]
            for h in idle:
                if not h.lock.acquire(blocking=False):
                    continue
                try:
                    with self._lock:
                        if self._handles.get(h.trajectory_id) is h:
                            del self._handles[h.trajectory_id]
                    log.info("sandbox of %s idle for %.0f s: removed", h.trajectory_id, now - h.last_used_s)
                    self._teardown(h)
                finally:
                    h.lock.release()
