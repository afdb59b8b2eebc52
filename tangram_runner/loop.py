"""The runner's loop (`runner` starts it once the zygote is forked): one request of the host's
at a time, answered with one JSON line (see `runner` for why the runner is PID 1 and holds the
requests, `protocol` for an action's request and facts).
"""

from __future__ import annotations

import json
import os
import socket
import traceback
from typing import Any

from tangram_runner.control import Connections, Control
from tangram_runner.fs import reset_tops
from tangram_runner.jobs import handle, harness_request, warm_up
from tangram_runner.proc import Zygote, prime
from tangram_runner.protocol import RunRequest, Seat
from tangram_runner.reaping import kill_all, strays
from tangram_runner.scrub import scrub
from tangram_runner.session import SESSION


def serve(sock_path: str, uid: int, workdir: str, started: tuple[int, socket.socket]) -> None:
    """Answer the host's requests one at a time, forever. `started`: the zygote `runner.main`
    forked before this process imported its own modules or read a request."""
    seat = Seat(uid, workdir)
    zygote = _start(seat, started)
    srv = _listen(sock_path)
    control = Control(srv)  # the host's requests while an action runs (control)
    conns = Connections(srv)
    while True:
        conn = conns.next_request()
        data = _read(conn)
        if data is None:  # the host closed it (or broke off a request): not one
            conns.drop(conn)
            continue
        out, primed = _answer(data, seat, zygote, control)
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
            _prime(primed, seat, zygote, fresh=False)


def _start(seat: Seat, started: tuple[int, socket.socket]) -> Zygote:
    """The workdir and /tmp handed to the sandbox uid, and the zygote `started` taken over."""
    for path in (seat.workdir, "/tmp"):  # fresh mounts: nothing of the user's there yet
        os.chown(path, seat.uid, seat.uid, follow_symlinks=False)
        os.chmod(path, 0o1777 if path == "/tmp" else 0o755)
    zygote = Zygote()
    zygote.adopt(started)
    zygote.wait_ready()  # part of the sandbox's start, not of its first action
    return zygote


def _listen(sock_path: str) -> socket.socket:
    """The runner's socket, root's only, at `sock_path` once it accepts."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = sock_path + ".new"
    if os.path.exists(tmp):
        os.unlink(tmp)
    srv.bind(tmp)
    os.chmod(tmp, 0o600)
    srv.listen(8)
    os.rename(tmp, sock_path)  # appears only once it accepts
    return srv


def _read(conn: socket.socket) -> bytearray | None:
    """One request line, or None when the connection ended before a whole one."""
    try:
        data = bytearray()  # grows in place: a request of files can be megabytes
        while not data.endswith(b"\n"):
            chunk = conn.recv(1 << 16)  # no mmap per read (glibc's threshold: 128 KiB)
            if not chunk:
                break
            data += chunk
    except OSError:
        data = bytearray()
    return data if data.endswith(b"\n") else None


def _answer(
    data: bytearray, seat: Seat, zygote: Zygote, control: Control
) -> tuple[dict[str, Any], dict | None]:
    """The answer to one request, and a verifier to start once it is sent (after a scrub)."""
    primed: dict | None = None
    try:
        msg = json.loads(data)
        out: dict[str, Any]
        if msg.get("op") == "ping":  # the host's, when the sandbox has started
            if msg.get("prime"):  # a ready sandbox: warm, before the host offers it
                _prime(msg["prime"], seat, zygote, fresh=True)
            out = {"pong": True}
        elif msg.get("op") == "scrub":  # between occupants (scrub); the session ends first
            SESSION.close(zygote)
            out = scrub(seat, zygote, kill_all, reset_tops, strays)
            primed = msg.get("prime") if out["scrubbed"] else None
        elif msg.get("op") == "dop":  # for an action that is not running (any more)
            out = {"applied": False}
        else:  # an action: parsed here, once, and refused unless of the host's own version
            out = handle(RunRequest.from_dict(msg), seat, zygote, control.attach)
    except Exception as e:
        out = {"runner_error": f"{e!r}\n{traceback.format_exc()[-2000:]}"}
        primed = None
    return out, primed


def _prime(spec: dict, seat: Seat, zygote: Zygote, fresh: bool) -> None:
    """Have a verifier waiting for the next occupant's first assert test, with the limits its
    actions will ask for (`spec`: the host's `nofile` and `pythonpath`): forked now from the
    zygote, so no user code has talked to it, and warmed up (its first-use costs paid here,
    off that test's path). In a `fresh` sandbox (before it is offered), through one test of
    the harness's own with a user process, which also warms the runner and the zygote
    (`jobs.warm_up`); after a scrub (`proc.prime`), inside the verifier only
    (`verifier.warm_up`), unless the host says `warm_verifier: false` (its pool is short: the
    CPU goes to actions then): a user process, of the user code's uid, would race the host's
    check for processes of that uid."""
    try:
        base = harness_request(nofile=spec.get("nofile") or 0)
        if fresh and zygote.alive():
            warm_up(base._replace(pythonpath=[str(p) for p in spec.get("pythonpath", [])]), seat, zygote)
        elif not fresh and zygote.alive():
            prime(base, seat, zygote, warm=bool(spec.get("warm_verifier", True)))
    except Exception:
        pass  # the first assert test starts a verifier, as without
