"""Allocate-on-execution, shared by both backends: one warm sandbox per trajectory.

A trajectory's sandbox (container or bubblewrap namespace) starts on its first action with a
resident runner as PID 1 and lives until `close_trajectory` or `idle_ttl_s` without actions.
Before each exec the action's cores are bound (cpuset + CFS quota); after it the runner has
killed every process of the action, so the cores are free again. Backends only say how to
start, bind and destroy a sandbox; the exec path, the limits and the statuses live here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
import threading
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tangram_celery.actions import ActionStatus
from tangram_celery.config import SandboxConfig
from tangram_celery.errors import SandboxError
from tangram_celery.sandbox.base import ExecRequest, ExecResult
from tangram_celery.sandbox.cgroups import CgroupSet
from tangram_celery.sandbox.limits import (
    RUNNER_GRACE_S,
    TOOLS_PATH,
    Limits,
    counter_delta,
    runner_payload,
    to_result,
)
from tangram_celery.sandbox.stage import SandboxScope, Stage

log = logging.getLogger(__name__)
START_TIMEOUT_S = 20.0


class RunnerGone(Exception):
    """The runner closed the connection or its socket vanished (the sandbox died)."""


class RunnerTimeout(Exception):
    """The runner did not answer within the action's timeout plus a grace period."""


@dataclass
class Handle:
    """One trajectory's live sandbox."""

    trajectory_id: str
    state_dir: Path  # root-only host dir bind-mounted at /run/tangram (holds the runner socket)
    memory_mb: int
    cores: tuple[int, ...]
    ref: Any = None  # backend object: docker Container or bwrap Popen
    cgroups: CgroupSet | None = None
    last_used_s: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def socket_path(self) -> Path:
        return self.state_dir / "runner.sock"


def call_runner(path: Path, payload: dict[str, Any], timeout_s: float, owner_uid: int = 0) -> dict[str, Any]:
    """One request/response with the runner over its unix socket.

    Its directory is bound into the sandbox, so nothing in it is trusted: the socket is opened
    without following a link (O_PATH | O_NOFOLLOW), must be a socket owned by the runner's uid
    (`owner_uid`, root) in a directory still private to that uid — user code that got the
    directory handed over and planted its own "runner" is not talked to — and is connected
    through /proc/self/fd."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        fd = -1
        try:
            fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            sock, parent = os.fstat(fd), os.lstat(path.parent)
            if not stat.S_ISSOCK(sock.st_mode) or sock.st_uid != owner_uid:
                raise RunnerGone(f"{path.name} is not a socket of uid {owner_uid}: not the runner's")
            if parent.st_uid != owner_uid or parent.st_mode & 0o077:
                raise RunnerGone("the runner's directory is no longer private to it")
            s.connect(f"/proc/self/fd/{fd}")
            s.sendall(json.dumps(payload).encode() + b"\n")
            buf = bytearray()
            while not buf.endswith(b"\n"):
                chunk = s.recv(1 << 20)
                if not chunk:
                    raise RunnerGone("runner closed the connection")
                buf += chunk
        except TimeoutError:
            raise RunnerTimeout(f"no answer in {timeout_s:.1f} s") from None
        except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, OSError) as e:
            raise RunnerGone(repr(e)) from None
        finally:
            if fd >= 0:
                os.close(fd)
    out: dict[str, Any] = json.loads(buf)
    return out


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
            h.cgroups.bind_cores(cores)
        if memory_mb != h.memory_mb:
            h.cgroups.set_memory(memory_mb)

    # -- Sandbox protocol ------------------------------------------------------------------------
    def run(self, trajectory_id: str, request: ExecRequest) -> ExecResult:
        """Run `request` in the trajectory's warm sandbox, bound to `request.cores`."""
        h = self._acquire(trajectory_id, request)
        try:
            return self._exec(h, request)
        finally:
            h.last_used_s = time.monotonic()
            h.lock.release()

    def close_trajectory(self, trajectory_id: str) -> None:
        with self._lock:
            h = self._handles.pop(trajectory_id, None)
        if h is not None:
            with h.lock:
                self._teardown(h)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
        for h in handles:
            self._teardown(h)
        self.stage.close()

    def trajectories(self) -> list[str]:
        with self._lock:
            return list(self._handles)

    # -- internals -------------------------------------------------------------------------------
    def _acquire(self, tid: str, req: ExecRequest) -> Handle:
        """The trajectory's handle, locked, started if new or dead."""
        while True:
            with self._lock:
                h = self._handles.get(tid)
                if h is None:
                    d = self.state_root / uuid.uuid4().hex[:12]
                    d.mkdir(mode=0o700)
                    h = Handle(tid, d, req.memory_mb, tuple(req.cores))
                    self._handles[tid] = h
            h.lock.acquire()
            with self._lock:
                if self._handles.get(tid) is h:
                    break
            h.lock.release()  # reaped or closed meanwhile: take the new one
        if h.ref is not None and self._alive(h):
            return h
        try:
            if h.ref is not None:
                log.warning("sandbox of %s died; starting a fresh one", tid)
                self._destroy(h)
            h.memory_mb, h.cores = req.memory_mb, tuple(req.cores)
            t0 = time.monotonic()
            self._start(h)
            self._wait_ready(h)
            log.info("%s sandbox for %s ready in %.3f s", self.name, tid, time.monotonic() - t0)
        except BaseException:
            self._destroy(h)
            h.ref = None
            with self._lock:
                self._handles.pop(tid, None)
            h.lock.release()
            raise
        return h

    def _wait_ready(self, h: Handle) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if h.socket_path.exists():
                try:
                    if call_runner(h.socket_path, {"op": "ping"}, 5.0).get("pong"):
                        return
                except (RunnerGone, RunnerTimeout):
                    pass
            if not self._alive(h):
                raise SandboxError(f"{self.name} sandbox exited during start: {self._logs(h)}")
            time.sleep(0.005)
        raise SandboxError(f"{self.name} sandbox runner not ready in {START_TIMEOUT_S} s")

    def _logs(self, h: Handle) -> str:
        return ""

    def _exec(self, h: Handle, req: ExecRequest) -> ExecResult:
        cores = tuple(req.cores)
        self._bind(h, cores, req.memory_mb)
        h.cores, h.memory_mb = cores, req.memory_mb
        payload = runner_payload(req, self.limits, self.pythonpath)
        before = h.cgroups.counters() if h.cgroups else None
        t0 = time.monotonic()
        try:
            facts = call_runner(h.socket_path, payload, req.timeout_s + RUNNER_GRACE_S)
        except (RunnerGone, RunnerTimeout) as e:
            after = h.cgroups.counters() if h.cgroups else None
            delta = counter_delta(before, after)
            self._teardown_in_place(h)
            status = ActionStatus.TIMEOUT if isinstance(e, RunnerTimeout) else ActionStatus.ERROR
            if delta.get("oom_kill", 0) > 0:
                status = ActionStatus.MEMORY_LIMIT
            detail = f"sandbox runner lost ({e}); the trajectory's sandbox was reset"
            log.warning("%s: %s", h.trajectory_id, detail)
            return ExecResult(status=status, exec_s=time.monotonic() - t0, detail=detail)
        if "runner_error" in facts:
            return ExecResult(
                status=ActionStatus.ERROR, detail=str(facts["runner_error"]), exec_s=time.monotonic() - t0
            )
        after = h.cgroups.counters() if h.cgroups else None
        return to_result(facts, counter_delta(before, after), req)

    def _teardown_in_place(self, h: Handle) -> None:
        """Destroy a broken sandbox but keep the handle: the next action starts a fresh one."""
        self._destroy(h)
        h.ref = None
        h.cgroups = None

    def _teardown(self, h: Handle) -> None:
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
