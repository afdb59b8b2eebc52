"""The host's connections to the runner, and control of the running action over them (stdlib
only).

The runner answers one request at a time and is busy while an action runs. A test suite
given as test cases is malleable: the host may lend its action more cores while it runs, or take
some back (`WarmPool.resize`). While an action runs, the runner's listening socket is watched by
the action's pump (`Action.watch`), and a connection that arrives then is one of these:

    {"op": "dop", "key": <the action's key>, "cores": [...]}  -> {"applied": true, "dop": n}

The action's DoP becomes len(cores): `run_tests` starts cases while fewer than that many run, so
more cases run at once after a loan and, after a take-back, no new case starts until the cases in
flight are below the new count (those keep running; the cpuset the host bound decides where).
The key is the one the action's request carried: a request for another action (or for one that
ended) changes nothing. Only root can reach the socket (a root-only directory, a 0600 socket),
so user code can send none of this.

Between actions, the runner reads the host's requests from every connection it has
(`Connections`): the one the host keeps for the sandbox's occupants, and any opened for one
request.
"""

from __future__ import annotations

import json
import selectors
import socket
from typing import Any

MAX_REQUEST_B = 4096
READ_TIMEOUT_S = 1.0


def apply_dop(act: Any, msg: dict[str, Any]) -> dict[str, Any]:
    """Change the running action's DoP to the number of cores `msg` (the host's "dop" message)
    names (see the module doc)."""
    key = act.req.key if act is not None else None
    if not key or msg.get("key") != key:
        return {"applied": False}
    cores = [int(c) for c in msg.get("cores", [])]
    if not cores:
        return {"applied": False, "error": "no cores"}
    act.dop = len(cores)
    act.req = act.req._replace(cores=cores)  # without cgroups, new processes pin to these
    return {"applied": True, "dop": act.dop}


def accept_now(srv: socket.socket) -> socket.socket | None:
    """A connection waiting on the listening socket `srv` (blocking), None if there is none
    (it went away between the poll that saw it and now)."""
    srv.setblocking(False)
    try:
        conn, _ = srv.accept()
    except (BlockingIOError, InterruptedError):
        return None
    finally:
        srv.setblocking(True)
    conn.setblocking(True)
    return conn


class Connections:
    """The host's connections: it keeps one open per sandbox for its occupants' requests
    (`tangram_celery.sandbox.link.RunnerLink`) and opens others for one request each. A
    connection is read only between requests, one whole request at a time, and answered on
    itself; it stays open until the host closes it (the runner never closes one the host may
    have sent a request on). Only root can connect (see `loop.serve`)."""

    def __init__(self, srv: socket.socket) -> None:
        self.srv = srv
        self.sel = selectors.DefaultSelector()
        self.sel.register(srv, selectors.EVENT_READ)

    def next_request(self) -> socket.socket:
        """The next connection with a request (or an end) to read; accepts new ones meanwhile."""
        while True:
            for key, _ in self.sel.select():
                if key.fileobj is not self.srv:
                    return key.fileobj  # type: ignore[return-value]
                conn = accept_now(self.srv)
                if conn is not None:
                    self.sel.register(conn, selectors.EVENT_READ)

    def drop(self, conn: socket.socket) -> None:
        self.sel.unregister(conn)
        conn.close()


class Control:
    """Answers the host's control requests while an action runs (`attach` it to the action)."""

    def __init__(self, srv: socket.socket) -> None:
        self.srv = srv
        self.act: Any = None

    def attach(self, act: Any) -> None:
        self.act = act
        act.watch(self.srv.fileno(), self.on_readable)

    def on_readable(self) -> None:
        conn = accept_now(self.srv)
        if conn is None:
            return
        with conn:
            try:
                conn.settimeout(READ_TIMEOUT_S)
                data = b""
                while not data.endswith(b"\n") and len(data) < MAX_REQUEST_B:
                    chunk = conn.recv(MAX_REQUEST_B)
                    if not chunk:
                        break
                    data += chunk
                msg = json.loads(data)
                if msg.get("op") == "dop":
                    out = apply_dop(self.act, msg)
                elif msg.get("op") == "ping":
                    out = {"pong": True}
                else:
                    out = {"runner_error": "busy: an action is running"}
                conn.sendall(json.dumps(out).encode() + b"\n")
            except (OSError, ValueError, TypeError, AttributeError):
                pass  # the host retries or gives up; the action goes on
