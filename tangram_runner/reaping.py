"""The end of an action in the sandbox: orphans collected, stray processes found, and the
`kill(-1)` from PID 1 that takes everything but the runner."""

from __future__ import annotations

import os
import signal


def reap_orphans() -> None:
    """Collect orphans that ended (reparented to PID 1)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def strays(keep: set[int | None]) -> bool:
    """Is any process other than these (the runner, the zygote, idle verifiers) alive? Zombies do
    not count."""
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in keep:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in (b"Z", b"X"):
            return True
    return False


def kill_all() -> None:
    """SIGKILL every process of the sandbox but the runner, and reap them all."""
    if os.getpid() != 1:  # kill(-1) outside a pid namespace would hit the whole host
        raise RuntimeError("runner is not PID 1; refusing kill(-1)")
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
