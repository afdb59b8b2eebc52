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
or destroyed when it cannot be scrubbed or looks tampered with: that life of the sandboxes apart
from their actions is `lifecycle.SandboxLifecycle`'s. Backends only say how to start, bind and
destroy a sandbox; the exec path, the limits and the statuses live here.

The scheduler names each trajectory sandbox's generation (`ExecRequest.sandbox_gen`): a
sandbox of an older generation is replaced, and an action that expected a sandbox and finds
none (lost with a restarted worker) or a dead one gets a fresh one with `sandbox_reset` set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

from tangram_celery.common.actions import ActionStatus
from tangram_celery.common.errors import SandboxError
from tangram_celery.sandbox.base import ExecRequest, ExecResult
from tangram_celery.sandbox.grading import (
    Changes,
    GradeRefused,
    seed_after_start,
    seed_before_start,
    trajectory_changes,
)
from tangram_celery.sandbox.handle import Handle
from tangram_celery.sandbox.image_checks import image_failure, image_refusal
from tangram_celery.sandbox.lifecycle import SandboxLifecycle
from tangram_celery.sandbox.limits import (
    RUNNER_GRACE_S,
    classify,
    counter_delta,
    runner_timeout_s,
    to_result,
)
from tangram_celery.sandbox.link import RunnerGone, RunnerTimeout, RunnerUnreachable
from tangram_celery.sandbox.oci import ImageError
from tangram_celery.sandbox.runner_request import runner_request
from tangram_runner.protocol import Facts, RunRequest

log = logging.getLogger(__name__)
KEEP_WAIT_S = 120.0  # an action waits this long at most for its trajectory's layer to be kept


class WarmPool(SandboxLifecycle):
    """The Sandbox implementation; subclasses provide `_start`, `_destroy`, `_alive`."""

    def run(self, trajectory_id: str, request: ExecRequest) -> ExecResult:
        """Run `request` in the trajectory's warm sandbox, bound to `request.cores`."""
        refused = self._image_refusal(trajectory_id, request)
        if refused:
            return ExecResult(status=ActionStatus.REJECTED, detail=refused)
        self._wait_kept(trajectory_id)
        if not request.image:  # a later action of an evicted (or forked) image trajectory
            with self._lock:
                live = trajectory_id in self._handles
            kept = None if live else self.images.kept_image(trajectory_id)
            if kept:
                request = dataclasses.replace(request, image=kept)
        try:
            h, reset = self._acquire(trajectory_id, request)
        except ImageError as e:  # this action's image: never the worker's failure
            return image_failure(e)
        if h.image is not None:
            self.image_ready.used(h.image)
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
        if h.kept_files:  # its files came back from its kept layer: not a reset, whatever was lost
            res.kept_files, h.kept_files, reset = True, False, False
        elif h.image is not None and trajectory_id in self.images.dropped:
            res.detail = "; ".join(filter(None, [res.detail, self.images.dropped.pop(trajectory_id)]))
        if reset:
            res.sandbox_reset = True
        return res

    def _wait_kept(self, tid: str) -> None:
        """An image trajectory evicted a moment ago: wait until its layer is kept (its teardown
        runs in the background), so that this action resumes its files."""
        with self._lock:
            keeping = self._keeping.get(tid)
        if keeping is not None and not keeping.wait(KEEP_WAIT_S):
            log.warning("%s: its layer was not kept within %.0f s; it may start afresh", tid, KEEP_WAIT_S)

    def _ready_for(self, tid: str, req: ExecRequest) -> Handle | None:
        """A ready sandbox for a new trajectory: the host's, or one of its image (none when the
        trajectory's own files are kept here: it resumes them)."""
        if not req.image:
            return self.ready.take(self._bound_for(req))
        if self.images.kept_image(tid) is not None:
            return None
        return self.image_ready.take(req.image, self._bound_for(req))

    def _image_refusal(self, tid: str, req: ExecRequest) -> str:
        """Why `req` cannot run in `tid`'s sandbox ("" when it can): the trajectory's first
        action fixed its image, and a later one may name only that one (or none)."""
        if not req.image:
            return ""
        with self._lock:
            h = self._handles.get(tid)
        had = h.image if h is not None else self.images.kept_image(tid)
        if (h is not None or had is not None) and had != req.image:
            runs = f"image {had!r}" if had else "the host toolchain"
            return f"trajectory {tid!r} runs in {runs}; an action of it named image {req.image!r}"
        return ""

    def prefetch(self, image: str) -> None:
        """Bring `image` onto this node ahead of the trajectories that will run in it, and keep
        ready sandboxes of it for them."""
        self.images.prefetch(image)
        self.image_ready.used(image)

    def images_report(self) -> dict[str, Any] | None:
        """This node's images (held with their sizes, fetchable) and kept layers; None when no
        image source is configured or reachable here."""
        return self.images.report()

    def fork(self, trajectory_id: str, new_ids: list[str]) -> int:
        """Start each of `new_ids` from a copy of `trajectory_id`'s files (its image's layer, kept
        here for their first actions); the bytes copied."""
        with self._lock:
            h = self._handles.get(trajectory_id)
        if h is None:
            raise SandboxError(f"trajectory {trajectory_id!r} has no sandbox on this node")
        with h.lock:
            return self.images.fork(h, new_ids)

    def run_once(self, request: ExecRequest) -> ExecResult:
        """Run `request` in a sandbox of its own (a ready one if any), discarded afterwards."""
        try:
            h = self._one_shot(request)
        except ImageError as e:
            return image_failure(e)
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

    def grade(self, trajectory_id: str, request: ExecRequest) -> ExecResult:
        """Judge the trajectory's files in a fresh one-shot sandbox of its image holding only its
        changes that are not test infrastructure; its own sandbox is left as it is (`grading`)."""
        refused = self._image_refusal(trajectory_id, request)
        if refused:
            return ExecResult(status=ActionStatus.REJECTED, detail=refused)
        self._wait_kept(trajectory_id)  # evicted a moment ago: grade what is kept
        with self._lock:
            h = self._handles.get(trajectory_id)
        try:
            with h.lock if h is not None else contextlib.nullcontext():  # no action writes meanwhile
                image, changes = trajectory_changes(
                    self.images, h, trajectory_id, self.limits.disk_quota_mb << 20
                )
            request = dataclasses.replace(request, image=image)
            h = self._one_shot(request, changes)
        except GradeRefused as e:
            return ExecResult(status=ActionStatus.REJECTED, detail=str(e))
        except ImageError as e:
            return image_failure(e)
        except (SandboxError, OSError) as e:
            return ExecResult(status=ActionStatus.ERROR, detail=f"cannot grade {trajectory_id!r}: {e}")
        try:
            return self._exec(h, request)
        finally:
            self._resizing.leave(request)
            self._dispose(h)

    def _one_shot(self, request: ExecRequest, changes: Changes | None = None) -> Handle:
        """A sandbox for a one-shot action: a ready one if any (not for an image), else one
        started now (a grade's: holding `changes`)."""
        bound = self._bound_for(request)
        h = None  # a grade's sandbox starts from its files: never a ready one
        if changes is None:
            h = self.image_ready.take(request.image, bound) if request.image else self.ready.take(bound)
        if h is None:
            h = self._new_handle("one-shot", request.memory_mb, tuple(request.cores))
            h.image = request.image
            h.trajectory_id = f"one-shot-{h.state_dir.name}"  # unique: Docker names containers by it
            try:
                if changes is not None:
                    seed_before_start(self.images, h, changes)
                self._start_and_wait(h)
                if changes is not None:
                    seed_after_start(self.images, h, changes)
            except BaseException:
                self._teardown(h)
                raise
        return h

    def close_trajectory(
        self, trajectory_id: str, generation: str | None = None, keep_files: bool = False
    ) -> None:
        """Remove the trajectory's sandbox (in the background); with `generation`, only if it
        is that one: a sandbox of a newer generation, started since, is kept. `keep_files`: an
        eviction, not a close: an image's layer is kept for the trajectory's next action."""
        with self._lock:
            h = self._handles.get(trajectory_id)
            if h is None or (generation and h.gen and h.gen != generation):
                if h is None and not keep_files and self.images.kept_image(trajectory_id):
                    self.images.retire_kept(trajectory_id)  # closed while evicted: its files go
                return
            del self._handles[trajectory_id]
            h.keep_files = keep_files
            if keep_files and h.image is not None:  # its next action waits for the layer
                self._keeping[trajectory_id] = threading.Event()
        self._dispose(h)

    def resize(self, action_id: str, cores: tuple[int, ...]) -> bool:
        """Re-bind a running action's sandbox to `cores` and tell its runner the new DoP
        (`tangram_celery.sandbox.resize`)."""
        return self._resizing.resize(action_id, cores)

    def start_prewarm(self) -> None:
        """Start keeping `sandbox.prewarm` sandboxes ready (once the backend is set up), and
        ready sandboxes of the images the node's store holds (`warm_images` at most): a
        restarted worker's new trajectories find them as before."""
        self.ready.start()
        for image in self.images.warm_candidates(self.cfg.images.warm_images):
            self.image_ready.used(image)

    def held(self) -> list[tuple[str, str]]:
        """(trajectory, generation) of every live trajectory sandbox."""
        with self._lock:
            return [(t, h.gen) for t, h in self._handles.items() if h.ref is not None]

    def close(self) -> None:
        self._stop.set()
        self.ready.close()
        self.image_ready.close()
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

    def _acquire(self, tid: str, req: ExecRequest) -> tuple[Handle, bool]:
        """The trajectory's handle, locked, with a live sandbox (a ready one handed out, or one
        started now); and whether that is a reset (see the module doc)."""
        while True:
            with self._lock:
                h = self._handles.get(tid)
            found = h is not None
            if h is None:  # a new trajectory (or one whose sandbox is gone): a ready sandbox
                ready = self._ready_for(tid, req)
                new = ready or self._new_handle(tid, req.memory_mb, tuple(req.cores))
                new.trajectory_id, new.gen = tid, req.sandbox_gen
                new.image = req.image
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
            ready = None if h.image else self.ready.take(self._bound_for(req))
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

    def _exec(self, h: Handle, req: ExecRequest, retry: bool = False) -> ExecResult:
        """Run `req` in `h`'s sandbox. With `retry`, a sandbox found dead before the request
        reached it is torn down and `RunnerUnreachable` raised (the caller runs it in another);
        otherwise that is reported as any lost runner is."""
        cores = self._resizing.enter(h, req)  # bound: the request's cores, or a loan's since
        request = runner_request(req, self.limits, self.pythonpath, self.cfg.compile_memory_mb)
        request = request._replace(cores=list(cores))
        if h.image is not None:  # the image's tools and Python, its environment under the caller's
            extras = self.images.runner_extras(h, req.language)
            refused = image_refusal(h.image, req, extras)
            if refused:
                return ExecResult(status=ActionStatus.REJECTED, detail=refused)
            request = request._replace(**{**extras, "env": {**extras["env"], **request.env}})
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
