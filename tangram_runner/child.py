"""What every process of user code (and the verifier) does between fork and its real work, and
the in-process Python fast path (stdlib only).

Order matters: descriptors are arranged and limits set while still root, then the process drops
to its uid for good (groups, gid, uid: real, effective and saved). The seccomp filter is in force
before anything of the user's runs: inherited from the zygote, which installs it on itself at
start (with PR_SET_NO_NEW_PRIVS; neither stops it from forking or setting a child's uid), or
installed here by a process that has none.
"""

from __future__ import annotations

import fcntl
import os
import resource
import signal
import sys
import traceback
import types
from typing import Any

from tangram_runner import boot, seccomp

RUNNER_PACKAGE = __name__.partition(".")[0]  # tangram_runner
# The harness's modules a user process drops, noted once by the zygote before it forks (None:
# scan sys.modules): a scan touches every module name, a copy-on-write fault on each page of
# them in every user process.
_runner_modules: tuple[str, ...] | None = None
_HIGH_FD = 256
_MAX_FD = 1 << 16
# What the zygote made once for its user processes (`make_std_streams`, `adopt_env`): the streams,
# never used, and the environment it has itself. Building either anew in every user process
# writes pages shared with the zygote (a copy-on-write fault each, the dearest part of a fork).
_std_streams: tuple[Any, Any, Any] | None = None
_zygote_env: dict[str, str] | None = None


def setup(
    uid: int,
    fds: list[int],
    workdir: str,
    cores: list[int],
    rlimits: dict[str, int],
    nofile: int,
    oom_score_adj: int,
) -> None:
    """In a fresh fork: `fds[i]` becomes descriptor i and every other descriptor is closed, limits
    are set, the process drops to `uid` and installs the seccomp filter. Raises on failure."""
    os.setsid()
    try:  # the OOM killer takes user code first, never the runner (no file object: cheaper)
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        try:
            os.write(fd, str(oom_score_adj).encode())
        finally:
            os.close(fd)
    except OSError:
        pass
    if cores:
        try:
            os.sched_setaffinity(0, cores)
        except OSError:
            pass  # the cgroup cpuset binds anyway
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, _HIGH_FD) for fd in fds]
    for i, fd in enumerate(moved):
        os.dup2(fd, i)
    os.closerange(len(fds), _MAX_FD)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    for name, value in rlimits.items():
        resource.setrlimit(getattr(resource, "RLIMIT_" + name), (int(value), int(value)))
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    os.chdir(workdir)
    os.umask(0o022)
    if not seccomp.installed():  # the zygote's filter is inherited; anything else installs it
        seccomp.install()


def note_runner_modules() -> None:
    """In the zygote, once its imports are done: remember which modules `prepare_python` drops."""
    global _runner_modules
    _runner_modules = tuple(n for n in sys.modules if n.partition(".")[0] == RUNNER_PACKAGE)


def make_std_streams() -> None:
    """In the zygote, once: the text streams a user process gets at descriptors 0, 1 and 2,
    made while those descriptors are what a user process's are (stdin a memfd: seekable; stdout
    and stderr pipes: not), then left unused; the zygote's own descriptors are put back. A user
    process takes them as they are (`prepare_python`) instead of opening its own."""
    global _std_streams
    saved: list[int | None] = []
    for fd in (0, 1, 2):
        try:
            saved.append(os.dup(fd))
        except OSError:
            saved.append(None)
    stdin = os.memfd_create("stdin", os.MFD_CLOEXEC)
    r, w = os.pipe()
    try:
        os.dup2(stdin, 0)
        os.dup2(w, 1)
        os.dup2(w, 2)
        _std_streams = _open_std_streams()
    finally:
        for fd, old in zip((0, 1, 2), saved, strict=True):
            if old is None:
                os.close(fd)
            else:
                os.dup2(old, fd)
                os.close(old)
        for fd in (stdin, r, w):
            os.close(fd)


def _open_std_streams() -> tuple[Any, Any, Any]:
    """As `python3` opens them in the sandbox's locale (C.UTF-8: UTF-8, and surrogateescape on
    stdin and stdout); stderr is line-buffered."""
    return (
        open(0, closefd=False, encoding="utf-8", errors="surrogateescape"),
        open(1, "w", closefd=False, encoding="utf-8", errors="surrogateescape"),
        open(2, "w", closefd=False, encoding="utf-8", errors="backslashreplace", buffering=1),
    )


def adopt_env(env: dict[str, str]) -> None:
    """In the zygote, before it forks a Python user process with `env`, the action's standard
    environment (the runner's spec says `std_env`: no variable of the caller's): make `env` its
    own, so that the process finds it set (`prepare_python`). Once per sandbox in practice:
    every action of a sandbox has the same standard environment."""
    global _zygote_env
    if env == _zygote_env:
        return
    _zygote_env = None  # until it is all set: a half-set environment is no one's
    os.environ.clear()
    os.environ.update(env)
    _zygote_env = dict(env)


def default_signals() -> None:
    """What an exec'd program expects (Python itself ignores SIGPIPE and SIGXFSZ)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)


def prepare_python(env: dict[str, str], workdir: str, argv0: str, preloaded: set[str]) -> None:
    """Make this (forked) interpreter look like a fresh `python3 argv0` in `workdir`."""
    if env != _zygote_env:
        os.environ.clear()
        os.environ.update(env)
    streams = _std_streams or _open_std_streams()
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams  # type: ignore[misc]
    sys.argv = [argv0]
    extra = [p for p in env.get("PYTHONPATH", "").split(":") if p]
    user_site = f"{workdir}/.local/lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"
    sys.path[:] = [workdir, *extra, *boot.own_paths("/lib")]
    if os.path.isdir(user_site):
        import site

        site.addsitedir(user_site)
    # a user's own module must win over one preloaded here, as it would in a fresh interpreter
    shadowed: set[str] = set()
    for d in [workdir, *extra, user_site]:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        shadowed.update(n[:-3] if n.endswith(".py") else n for n in names)
    shadowed &= preloaded
    runner = _runner_modules
    if runner is None:
        runner = tuple(n for n in sys.modules if n.partition(".")[0] == RUNNER_PACKAGE)
    for name in runner:
        sys.modules.pop(name, None)
    if shadowed:  # rare: only then look at every module's name
        for name in [n for n in sys.modules if n.partition(".")[0] in shadowed]:
            del sys.modules[name]


def run_main(
    path: str, source: str, compiled: types.CodeType | None = None
) -> tuple[int, types.ModuleType, BaseException | None]:
    """Run `source` as `__main__` from `path` (`__file__`, and what tracebacks name; the runner
    makes it absolute, as `python3 main.py` does: `launch.main_file`), or `compiled`,
    its code object compiled by the runner as `path`: (exit code as `python3` would give, the
    module, the exception that ended it, if any)."""
    main = types.ModuleType("__main__")
    main.__file__ = path
    sys.modules["__main__"] = main
    code = 0
    exc: BaseException | None = None
    try:
        # dont_inherit: this module's `from __future__ import annotations` is not the user's
        if compiled is None:
            compiled = compile(source, path, "exec", dont_inherit=True)
        exec(compiled, main.__dict__)
    except SystemExit as e:
        exc = e
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException as e:
        exc = e
        tb = e.__traceback__.tb_next if e.__traceback__ else None  # hide the runner's frame
        traceback.print_exception(type(e), e, tb)
        code = 1
    return code, main, exc


def flush() -> int:
    """Flush the standard streams; 1 if that failed (as the interpreter's exit would report)."""
    code = 0
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            code = 1
    return code


def read_all(fd: int) -> str:
    """The whole content of a memfd, from offset 0, as text."""
    return read_bytes(fd).decode("utf-8", "surrogatepass")


def read_bytes(fd: int) -> bytes:
    """The whole content of a memfd, from offset 0."""
    chunks: list[bytes] = []
    off = 0
    while True:
        b = os.pread(fd, 1 << 20, off)
        if not b:
            return b"".join(chunks)
        chunks.append(b)
        off += len(b)


def spec_get(spec: dict[str, Any], key: str, default: Any) -> Any:
    v = spec.get(key)
    return default if v is None else v
