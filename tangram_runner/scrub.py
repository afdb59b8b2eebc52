"""Scrubbing a sandbox between occupants (stdlib only): what lets the worker hand a sandbox that
ran one trajectory's code to another trajectory instead of building a new one.

The previous occupant's code was written by a policy paid for passing and may have tried to
leave something for the next one. The runner (PID 1, root in the sandbox) therefore:
1. kills the pooled verifiers that judged the previous occupant's own tests (talking to its
   code through proxies; SIGKILL by pidfd, so none of them runs again), but not their seed, a
   verifier that never got a job (neither has talked to user code), nor one of a group (it
   judges later occupants' tests only if their actions name its group, the job,
   `verifiers`); then, if any process but itself, the zygote, the seed and those
   verifiers is alive (nothing should be: every action
   ends with the runner killing what it left), or the zygote is gone, kills every process but
   itself with `kill(-1)` and exec's a fresh zygote.
   The zygote is root, never sees a request or user data, and user code cannot signal, trace or
   message it (another uid, seccomp, a socket only the runner holds): it is kept otherwise, as
   it is between the actions of one trajectory;
2. empties every place the sandbox user can write (/work, /tmp, /dev/shm if present) from a
   descriptor of the mount point, removing entries by name with `unlinkat`/`rmtree(dir_fd=)`:
   no link is ever followed, so a planted symlink is removed, not its target;
   The runner's cache of compiled builds (directories in /tmp) is forgotten first;
3. puts both mount points back to their owner and mode;
4. checks that no SysV IPC object exists in the sandbox's IPC namespace (user code cannot create
   one: the seccomp filter refuses shmget/semget/msgget and mq_open; one found means tampering).
It answers what it could not remove, and afterwards (when the host asks, and unless a verifier
that never got a job or one of a group is waiting) has the seed fork one verifier for the next
occupant's first assert test: a new process no user code has talked to (`runner.py`,
`proc.prime`). The host then checks from outside (no process of the sandbox uid in the
sandbox's cgroup, every process in the sandbox's pid namespace) and destroys the sandbox instead
of recycling it when anything is off. See docs/sandbox.md, "Recycling".
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING, Any

from tangram_runner import build

if TYPE_CHECKING:
    from tangram_runner.protocol import Seat

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
EXTRA_TOPS = ("/dev/shm",)  # writable places besides the workdir and /tmp, where they exist


def wipe(top: str) -> list[str]:
    """Remove everything under the directory `top` (not `top` itself) without following a link;
    return the names still there afterwards."""
    try:
        fd = os.open(top, _DIR_FLAGS)
    except FileNotFoundError:
        return []
    except OSError as e:
        return [f"{top}: {e.strerror}"]
    try:
        for name in os.listdir(fd):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    import shutil  # here, not at the top: see zygote.PRELOAD

                    shutil.rmtree(name, dir_fd=fd)
                else:
                    os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError:
                pass  # reported below
        return [f"{top}/{n}" for n in os.listdir(fd)]
    finally:
        os.close(fd)


def sysv_objects() -> list[str]:
    """SysV IPC objects of this IPC namespace (from /proc/sysvipc; the header line skipped)."""
    found = []
    for kind in ("shm", "msg", "sem"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        found += [f"{kind}: {r.split()[1]}" for r in rows if r.strip()]
    return found


def _drop_verifiers(zygote: Any) -> set[int]:
    """SIGKILL every pooled verifier that judged a test of the previous occupant's own (by
    pidfd, `VerifierPool.drop_used`); the pids the pool still holds: its seed, the verifiers
    that never got a job (neither has talked to user code) and those of a group (they stay),
    and the killed ones not yet exited. These are not waited for: a process with
    a SIGKILL pending never runs user-space code again, and their ends are seen with the next
    action's (`VerifierPool.prune`). A verifier that has exited no longer holds its pid, so
    that pid is not left out of the check for strays."""
    pool = zygote.verifiers
    pool.prune()
    pool.drop_used()
    return pool.pids()


def scrub(seat: Seat, zygote: Any, kill_all: Any, reset_tops: Any, strays: Any) -> dict[str, Any]:
    """Make the sandbox (`seat`) as a fresh one is for its next occupant; the facts for the
    host."""
    quiet = zygote.alive() and not strays({1, os.getpid(), zygote.pid, *_drop_verifiers(zygote)})
    if not quiet:
        kill_all()
        zygote.lost()
    build._cache.clear()  # the previous occupant's builds (in /tmp, wiped next) are no one's now
    left: list[str] = []
    for top in (seat.workdir, "/tmp", *EXTRA_TOPS):
        left += wipe(top)
    reset_tops(seat)
    ipc = sysv_objects()
    if not quiet:
        zygote.start()  # exec'd fresh
        zygote.wait_ready()
    return {
        "scrubbed": not left and not ipc,
        "left": left[:20],
        "ipc": ipc[:20],
        "pid": os.getpid(),
        "zygote_kept": quiet,
    }
