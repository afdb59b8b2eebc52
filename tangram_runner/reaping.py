"""The end of an action in the sandbox: orphans collected, stray processes found, and the
`kill(-1)` from PID 1 that takes everything but the runner."""

from __future__ import annotations

import os
import signal
import time

# processes that outlive the actions (the shell of the sandbox's session, `session`), pid ->
# pidfd: an action's end stops them (`stop_kept`), spares them and kills the rest by pid instead
# of `kill(-1)`
KEPT: dict[int, int] = {}
KILL_ROUNDS = 200


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


def stop_kept() -> None:
    """SIGSTOP the processes kept between actions: nothing of theirs runs until the next action
    that continues them (another process of the sandbox uid may have sent them SIGCONT)."""
    for pidfd in KEPT.values():
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGSTOP)
        except OSError:
            pass


def kill_others(keep: set[int | None], rounds: int = KILL_ROUNDS) -> bool:
    """SIGKILL (by pidfd) every process but those in `keep`, and reap orphans, until none is
    left (what a fork bomb forks while a round runs goes in the next one); False if some were
    still alive after `rounds`."""
    for i in range(rounds):
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in keep:
                continue
            try:
                fd = os.pidfd_open(int(name))
            except OSError:
                continue
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                found = True
            except OSError:
                pass
            finally:
                os.close(fd)
        reap_orphans()
        if not found or not strays(keep):
            return True
        time.sleep(0.001 * min(i, 10))
    return not strays(keep)
