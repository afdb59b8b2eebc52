"""Parent-death for every process Tangram starts: nothing outlives its parent, on any signal.

Standard library only: this file also runs as a script under the host's /usr/bin/python3 (the
exec wrapper for non-Python children, and inside sandboxes next to the launcher).

`PR_SET_PDEATHSIG` asks the kernel to signal a process when its parent dies, but it has two
gaps that each left processes behind in practice:
- it is armed by the child itself, after fork (and after exec for a program that arms itself):
  if the parent dies in between, the child is re-parented and the signal never comes. So every
  child arms first and *then* checks that its parent still lives: `getppid()` against the pid it
  was started by, or a *lifeline* pipe whose write end only the parent holds (end of file on
  the read end = the parent is gone; this also works across a pid namespace, where getppid()
  is 0).
- it fires when the parent *thread* that forked the child exits, not the parent process. So
  children are started from one long-lived thread per process (`spawn`).

As a script: `lifeline.py [--ppid PID] [--fd FD] [--signal NAME] -- PROGRAM ARGS...` arms the
parent-death signal (SIGKILL by default), checks the parent, closes FD and execs PROGRAM.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import signal
import sys
import threading
from typing import Any

PR_SET_PDEATHSIG = 1
PARENT_ENV = "TANGRAM_PARENT_PID"  # set by `tangram up` for its Python children
EXIT_ORPHANED = 70

_libc: Any = None


def libc() -> Any:
    """The C library, loaded once (use_errno so failures carry errno)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def set_pdeathsig(sig: int) -> None:
    """Ask the kernel to send `sig` to this process when its parent thread exits."""
    if libc().prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")


def lifeline_cut(fd: int) -> bool:
    """True when every write end of the lifeline pipe `fd` is closed (the parent is gone)."""
    p = select.poll()
    p.register(fd, select.POLLIN | select.POLLHUP)
    return any(ev & (select.POLLHUP | select.POLLERR | select.POLLIN) for _, ev in p.poll(0))


def arm(sig: int = signal.SIGKILL, ppid: int | None = None, fd: int | None = None) -> bool:
    """Arm the parent-death signal, then check the parent: False when it is already gone."""
    set_pdeathsig(sig)
    if ppid is not None and os.getppid() != ppid:
        return False
    return not (fd is not None and lifeline_cut(fd))


def arm_from_env(sig: int = signal.SIGKILL) -> None:
    """In a Python child of `tangram up`: die with it (exit at once if it is already gone).

    The variable is removed so that this process's own children do not check the wrong parent."""
    raw = os.environ.pop(PARENT_ENV, "")
    if not raw:
        return
    if not arm(sig, ppid=int(raw)):
        os._exit(EXIT_ORPHANED)


def wrapper_argv(
    argv: list[str], ppid: int, sig: int = signal.SIGKILL, python: str | None = None
) -> list[str]:
    """`argv` behind the exec wrapper, which arms `sig` against parent `ppid` first."""
    return [
        python or sys.executable,
        "-E",
        "-s",
        "-S",
        os.path.abspath(__file__),
        "--ppid",
        str(ppid),
        "--signal",
        signal.Signals(sig).name,
        "--",
        *argv,
    ]


_spawner: Any = None
_spawner_lock = threading.Lock()


def spawn(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run `fn(*args, **kwargs)` (e.g. subprocess.Popen) on this process's one long-lived
    spawner thread, so that a child's parent-death signal fires when this *process* ends,
    not when some short-lived caller thread does."""
    global _spawner
    from concurrent.futures import ThreadPoolExecutor

    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(1, thread_name_prefix="tangram-spawner")
        ex = _spawner
    return ex.submit(fn, *args, **kwargs).result()


def main(argv: list[str]) -> int:
    """The exec wrapper (see the module docstring)."""
    if "--" not in argv:
        print("usage: lifeline.py [--ppid PID] [--fd FD] [--signal NAME] -- PROGRAM ARGS...", file=sys.stderr)
        return 2
    split = argv.index("--")
    opts = dict(zip(argv[:split:2], argv[1:split:2], strict=False))
    program = argv[split + 1 :]
    sig = signal.Signals["SIG" + opts.get("--signal", "KILL").removeprefix("SIG")]
    ppid = int(opts["--ppid"]) if "--ppid" in opts else None
    fd = int(opts["--fd"]) if "--fd" in opts else None
    if not arm(sig, ppid=ppid, fd=fd):
        return EXIT_ORPHANED
    if fd is not None:
        os.close(fd)
    os.execvp(program[0], program)
    return 127  # pragma: no cover - execvp does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
