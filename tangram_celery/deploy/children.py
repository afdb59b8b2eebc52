"""The deployment's child processes: how one is started, watched, counted and stopped.

Every child is started from the process's one spawner thread with a parent-death signal
(`tangram_celery.common.lifeline`), in its own session, logging to <state_dir>/logs/<name>.log.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tangram_celery.common import lifeline
from tangram_celery.common.errors import TangramError

log = logging.getLogger("tangram.deploy")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)
    restarts: list[float] = field(default_factory=list)  # monotonic times of restarts
    # how to start it again when it is not `tangram <args>` (Flower); None with no args: never
    again: Callable[[], Child] | None = None


def log_path(state_dir: Path, name: str) -> Path:
    """<state_dir>/logs/<name>.log (the folder made private on first use)."""
    logs = state_dir / "logs"
    logs.mkdir(mode=0o700, parents=True, exist_ok=True)
    return logs / f"{name}.log"


def popen(cmd: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start `cmd` from the process's one spawner thread (parent-death fires per thread)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        proc: subprocess.Popen[bytes] = lifeline.spawn(
            subprocess.Popen,
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # a Ctrl-C in the terminal reaches only us; we stop them
        )
    finally:
        os.close(fd)
    return proc


def check_alive(children: Iterable[Child]) -> None:
    """Raise TangramError, with the end of its log, for the first child that has exited."""
    for c in children:
        if c.proc.poll() is not None:
            tail = c.log_path.read_text(errors="replace")[-2000:] if c.log_path.exists() else ""
            raise TangramError(f"{c.name} exited with {c.proc.returncode}; last log lines:\n{tail}")


def may_restart(name: str, restarts: list[float], max_per_min: int) -> bool:
    """Count one more restart of `name` in `restarts` (the last minute's); False, said
    once in the log, when it has exited too often to try again."""
    now = time.monotonic()
    restarts[:] = [t for t in restarts if now - t < 60] + [now]
    if len(restarts) > max_per_min:
        log.error("%s keeps exiting (%d restarts in 60 s); giving up", name, len(restarts))
        return False
    return True


def signal_child(c: Child, sig: int) -> int:
    """Signal a child's process group (fault injection) and reap it; returns its pid."""
    if c.proc.poll() is None:
        os.killpg(c.proc.pid, sig)
        c.proc.wait(timeout=30)
    return c.proc.pid


def stop_all(children: list[Child], grace_s: float = 15.0) -> None:
    """SIGTERM every child still running (last started first), SIGKILL after `grace_s`."""
    for c in reversed(children):
        if c.proc.poll() is None:
            try:
                os.killpg(c.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
    for c in children:
        try:
            c.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait()
