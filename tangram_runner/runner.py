"""Resident runner: PID 1 inside one trajectory's sandbox (stdlib only, runs on the host's python3).

It listens on a unix socket that only root can reach, reads one JSON request at a time (over a
connection the host keeps open for the sandbox's occupants, or one of its own:
`control.Connections`), runs it as the unprivileged sandbox uid and answers one JSON line of
*facts* (exit code, output, flags such as timed_out / output_capped / disk_full:
`protocol.Facts`); the host turns facts into a status.

Why PID 1: orphans of user code are reparented to it, and `kill(-1, SIGKILL)` from PID 1 reaches
every other process of the sandbox (daemons, double forks, fork bombs) and nothing outside it;
the sandboxed uid cannot signal PID 1.

The runner holds requests, so nothing is ever forked from its memory: user processes and the
verifiers of assert tests (another uid, `verifier`) come from the zygote (`zygote`,
forked at the runner's start, before it imports its own modules, or exec'd fresh; warm, holding
nothing secret), and expected outputs are compared here. See
docs/sandbox.md, "Threat model".
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

# Only what the zygote imports too, up to `main`'s fork of it (`forkserver.fork_zygote`);
# the runner's own modules come after, in `serve`.
from tangram_runner.forkserver import fork_zygote

_PR_SET_DUMPABLE = 4


def _harden() -> None:
    """No supplementary groups (file operations switch only uid and gid), not dumpable."""
    import ctypes

    os.setgroups([])
    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def serve(sock_path: str, uid: int, workdir: str, started: tuple[int, socket.socket]) -> None:
    """Answer the host's requests one at a time, forever. `started`: the zygote `main` forked before
    this process imported its own modules or read a request."""
    from tangram_runner.control import Connections, Control
    from tangram_runner.fs import reset_tops
    from tangram_runner.jobs import handle, warm_up
    from tangram_runner.proc import Zygote, prime
    from tangram_runner.protocol import check_version
    from tangram_runner.reaping import kill_all, strays
    from tangram_runner.scrub import scrub

    for path in (workdir, "/tmp"):  # fresh mounts: nothing of the user's there yet
        os.chown(path, uid, uid, follow_symlinks=False)
        os.chmod(path, 0o1777 if path == "/tmp" else 0o755)
    zygote = Zygote()
    zygote.adopt(started)
    zygote.wait_ready()  # part of the sandbox's start, not of its first action
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = sock_path + ".new"
    if os.path.exists(tmp):
        os.unlink(tmp)
    srv.bind(tmp)
    os.chmod(tmp, 0o600)
    srv.listen(8)
    os.rename(tmp, sock_path)  # appears only once it accepts
    control = Control(srv)  # the host's requests while an action runs (control)
    conns = Connections(srv)
    while True:
        conn = conns.next_request()
        primed: dict | None = None  # a verifier to start once answered (after a scrub)
        try:
            data = bytearray()  # grows in place: a request of files can be megabytes
            while not data.endswith(b"\n"):
                chunk = conn.recv(1 << 16)  # no mmap per read (glibc's threshold: 128 KiB)
                if not chunk:
                    break
                data += chunk
        except OSError:
            data = bytearray()
        if not data.endswith(b"\n"):  # the host closed it (or broke off a request): not one
            conns.drop(conn)
            continue
        try:
            req = json.loads(data)
            out: dict
            if req.get("op") == "ping":  # the host's, when the sandbox has started
                if req.get("prime"):  # a ready sandbox: warm, before the host offers it
                    _prime(req["prime"], uid, workdir, zygote, warm_up, None)
                out = {"pong": True}
            elif req.get("op") == "scrub":  # between occupants (scrub)
                out = scrub(uid, workdir, zygote, kill_all, reset_tops, strays)
                primed = req.get("prime") if out["scrubbed"] else None
            elif req.get("op") == "dop":  # for an action that is not running (any more)
                out = {"applied": False}
            else:
                check_version(req)  # a request of the host's own protocol (`protocol.RunRequest`)
                out = handle({**req, "uid": uid, "workdir": workdir}, zygote, control.attach)
        except Exception as e:
            out = {"runner_error": f"{e!r}\n{traceback.format_exc()[-2000:]}"}
            primed = None
        try:
            conn.sendall(json.dumps(out).encode() + b"\n")
        except OSError:
            conns.drop(conn)
        if not zygote.alive():  # killed with a stray at the end of the action: warm up again now
            zygote.start()
            try:
                zygote.wait_ready()
            except Exception:
                zygote.stop()  # the next spawn tries again
        if primed is not None:
            _prime(primed, uid, workdir, zygote, None, prime)


def _prime(
    spec: dict, uid: int, workdir: str, zygote: Any, warm_up: Callable | None, prime: Callable | None
) -> None:
    """Have a verifier waiting for the next occupant's first assert test, with the limits its
    actions will ask for (`spec`: the host's `nofile` and `pythonpath`): forked now from the
    zygote, so no user code has talked to it, and warmed up (its first-use costs paid here,
    off that test's path). With `warm_up` (a new sandbox, before it is offered), through one
    test of the harness's own with a user process, which also warms the runner and the zygote
    (`jobs.warm_up`); after a scrub, with `prime` (`proc.prime`), inside the
    verifier only (`verifier.warm_up`), unless the host says `warm_verifier: false`
    (its pool is short: the CPU goes to actions then): a user process, of the user code's uid,
    would race the host's check for processes of that uid. (Both are passed in, imported once
    by `serve`: an import here would search the path anew each time, the first form failing
    inside the sandbox.)"""
    base = {"uid": uid, "workdir": workdir, "nofile": spec.get("nofile")}
    try:
        if warm_up is not None and zygote.alive():
            warm_up({**base, "pythonpath": [str(p) for p in spec.get("pythonpath", [])]}, zygote)
        elif prime is not None and zygote.alive():
            prime(base, zygote, warm=bool(spec.get("warm_verifier", True)))
    except Exception:
        pass  # the first assert test starts a verifier, as without


def main() -> None:
    args = dict(zip(sys.argv[1::2], sys.argv[2::2], strict=False))
    _harden()  # first: the zygote inherits it (not dumpable)
    started = fork_zygote()  # before the runner's own modules: see fork_zygote
    serve(args["--socket"], int(args["--uid"]), args["--workdir"], started)


if __name__ == "__main__":
    main()
