"""The life of a pool's sandboxes, apart from the actions they run (`pool.WarmPool` runs those):
started (for a trajectory, or ready in advance: `ReadyPool`), waited for until the runner
answers, scrubbed and recycled into the ready pool when an occupant is done
(docs/sandbox.md "Recycling") or destroyed, and removed after `idle_ttl_s` without actions.
Backends only say how to start, bind and destroy a sandbox (`_start`, `_bind`, `_destroy`,
`_alive`).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from abc import ABC, abstractmethod
from typing import Any

from tangram_celery.common.config import SandboxConfig
from tangram_celery.common.errors import SandboxError
from tangram_celery.sandbox.handle import Handle
from tangram_celery.sandbox.image_layers import ImageLayers
from tangram_celery.sandbox.image_ready import ImageReady
from tangram_celery.sandbox.limits import TOOLS_PATH, Limits
from tangram_celery.sandbox.link import RunnerGone, RunnerTimeout, call_runner
from tangram_celery.sandbox.prewarm import BACKGROUND_DELAY_S, Disposer, ReadyPool
from tangram_celery.sandbox.resize import Resizing
from tangram_celery.sandbox.stage import SandboxScope, Stage

log = logging.getLogger("tangram_celery.sandbox.pool")
START_TIMEOUT_S = 20.0
SCRUB_TIMEOUT_S = 20.0


class SandboxLifecycle(ABC):
    """A pool's sandboxes and their state; `pool.WarmPool` adds the Sandbox interface."""

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
        self.images = ImageLayers(cfg, self.stage.dir / "layers", cfg.docker_host)
        self.image_ready = ImageReady(
            cfg.images.prewarm, cfg.images.warm_images, self._start_ready_image, self._teardown, self._alive
        )
        self._sweep_previous()  # before serving: the previous incarnation's sandboxes go
        self._handles: dict[str, Handle] = {}
        self._keeping: dict[str, threading.Event] = {}  # evicted image trajectories being kept
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

    def _start_ready_image(self, image: str) -> Handle:
        """A started sandbox of `image` with a fresh layer, for the image's next new trajectory
        (`image_ready`), on the cores the last taker asked for."""
        cores = self._taken_cores or (self._prewarm_cores[self._started % len(self._prewarm_cores)],)
        h = self._new_handle("ready", self.cfg.default_memory_mb, cores)
        h.trajectory_id, h.image = f"ready-{h.state_dir.name}", image
        try:
            self._start_and_wait(h)
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
            # an image's sandbox is never another occupant's: the ready pool is the host's
            if self._recycling and h.image is None and not self._stop.is_set() and self._alive(h):
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

    def _wait_ready(self, h: Handle, prime: bool = False) -> None:
        """Until the runner answers; with `prime` (a ready sandbox), it first starts a verifier
        and runs one test of its own through it (`tangram_runner.loop._prime`)."""
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

    def _teardown_in_place(self, h: Handle) -> None:
        """Destroy a broken sandbox but keep the handle: the next action starts a fresh one."""
        h.drop_link()
        self._destroy(h)
        h.ref = None
        h.cgroups = None

    def _release_image(self, h: Handle) -> None:
        """After an image sandbox's teardown: keep or delete its layer (namespace backend)."""
        self.images.retire(h)

    def _teardown(self, h: Handle) -> None:
        h.drop_link()
        self._destroy(h)
        h.ref = None
        try:
            if h.image is not None:  # its layer kept (evicted) or deleted (closed), image released
                try:
                    self._release_image(h)
                except Exception as e:  # must not raise: a teardown runs on every path out
                    log.warning("layer of %s not kept: %s", h.trajectory_id, e)
        finally:
            # before the trajectory's next action may go on: a kept Docker container binds this
            # directory, and its restart makes it again (removed after, its socket was lost)
            shutil.rmtree(h.state_dir, ignore_errors=True)
            with self._lock:
                keeping = self._keeping.pop(h.trajectory_id, None) if h.keep_files else None
            if keeping is not None:
                keeping.set()

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
                    h.keep_files = True  # an image's files stay for its next action, within budget
                    self._teardown(h)
                finally:
                    h.lock.release()
