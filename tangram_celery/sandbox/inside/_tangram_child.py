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

try:
    from tangram_celery.sandbox.inside import _tangram_seccomp as seccomp
except ImportError:  # inside the sandbox this directory is sys.path[0]
    import _tangram_seccomp as seccomp  # type: ignore[no-redef]

RUNNER_MODULE_PREFIX = "_tangram_"
# The harness's modules a user process drops, noted once by the zygote before it forks (None:
# scan sys.modules): a scan touches every module name, a copy-on-write fault on each page of
# them in every user process.
_runner_modules: tuple[str, ...] | None = None
_HIGH_FD = 256
_MAX_FD = 1 << 16


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
    _runner_modules = tuple(n for n in sys.modules if n.startswith(RUNNER_MODULE_PREFIX))


def default_signals() -> None:
    """What an exec'd program expects (Python itself ignores SIGPIPE and SIGXFSZ)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)


def prepare_python(env: dict[str, str], workdir: str, argv0: str, preloaded: set[str]) -> None:
    """Make this (forked) interpreter look like a fresh `python3 argv0` in `workdir`."""
    os.environ.clear()
    os.environ.update(env)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")  # noqa: SIM115
    sys.argv = [argv0]
    extra = [p for p in env.get("PYTHONPATH", "").split(":") if p]
    user_site = f"{workdir}/.local/lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"
    sys.path[:] = [workdir, *extra, *[p for p in sys.path if p.startswith("/usr/lib")]]
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
        runner = tuple(n for n in sys.modules if n.startswith(RUNNER_MODULE_PREFIX))
    for name in runner:
        sys.modules.pop(name, None)
    if shadowed:  # rare: only then look at every module's name
        for name in [n for n in sys.modules if n.partition(".")[0] in shadowed]:
            del sys.modules[name]


def run_main(argv0: str, source: str) -> tuple[int, types.ModuleType, BaseException | None]:
    """Run `source` as `__main__`: (exit code as `python3 argv0` would give, the module, the
    exception that ended it, if any)."""
    main = types.ModuleType("__main__")
    main.__file__ = argv0
    sys.modules["__main__"] = main
    code = 0
    exc: BaseException | None = None
    try:
        exec(compile(source, argv0, "exec"), main.__dict__)
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
    chunks: list[bytes] = []
    off = 0
    while True:
        b = os.pread(fd, 1 << 20, off)
        if not b:
            return b"".join(chunks).decode("utf-8", "surrogatepass")
        chunks.append(b)
        off += len(b)


def spec_get(spec: dict[str, Any], key: str, default: Any) -> Any:
    v = spec.get(key)
    return default if v is None else v
