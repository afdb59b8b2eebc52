"""The host's side of the runner's socket: one request, one JSON line back.

The runner's socket lives in a directory bound into the sandbox (`Handle.state_dir`), so nothing
in it is trusted. A connection is made without following a link (O_PATH | O_NOFOLLOW) to a
socket owned by the runner's uid in a directory still private to that uid, through
/proc/self/fd: user code that got the directory handed over and planted its own "runner" is not
talked to.

`call_runner` opens a connection per request (control requests, tests). `RunnerLink` keeps one
open per sandbox for the requests of its occupants (actions, the scrub between them): a new
trajectory's program costs a scrub and an action, and each connection costs both sides an open,
a connect or accept, and closes. Before each request over a kept connection, the directory and
the socket are checked again as at connect time (still private, still the same socket by
inode), so what the checks refused before is refused now too; any failure closes the
connection, so a late answer is never read as the next request's. A worker keeps at most
`MAX_KEPT` connections open (one file descriptor each, on a node that may hold a thousand
sandboxes): past that, the one used longest ago is closed, and its sandbox's next request
makes a new one.

Until a request is all sent, nothing of it can have run: the runner reads a whole line before it
acts. A failure before then is `RunnerUnreachable` (the caller may run the action elsewhere).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import stat
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

MAX_KEPT = 256  # kept connections per process, least recently used closed first


class RunnerGone(Exception):
    """The runner closed the connection or its socket vanished (the sandbox died)."""


class RunnerUnreachable(RunnerGone):
    """The request never reached the runner (no runner's socket, refused, reset before it was
    all sent): nothing of the action ran, so it can run in another sandbox instead."""


class RunnerTimeout(Exception):
    """The runner did not answer within the action's timeout plus a grace period."""


def _trusted(path: Path, st: os.stat_result, owner_uid: int) -> tuple[int, int]:
    """(device, inode) of the runner's socket `st` at `path`, after checking that it is a socket
    of `owner_uid` in a directory private to that uid; `RunnerUnreachable` otherwise."""
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != owner_uid:
        raise RunnerUnreachable(f"{path.name} is not a socket of uid {owner_uid}: not the runner's")
    parent = os.lstat(path.parent)
    if parent.st_uid != owner_uid or parent.st_mode & 0o077:
        raise RunnerUnreachable("the runner's directory is no longer private to it")
    return st.st_dev, st.st_ino


def _connect(path: Path, timeout_s: float, owner_uid: int) -> tuple[socket.socket, tuple[int, int]]:
    """A connection to the runner at `path` and the socket's (device, inode)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    fd = -1
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        ident = _trusted(path, os.fstat(fd), owner_uid)
        s.connect(f"/proc/self/fd/{fd}")
    except BaseException as e:
        s.close()
        if isinstance(e, RunnerUnreachable):
            raise
        if isinstance(e, OSError):  # includes a connect that timed out: nothing was sent
            raise RunnerUnreachable(repr(e)) from None
        raise
    finally:
        if fd >= 0:
            os.close(fd)
    return s, ident


def _exchange(s: socket.socket, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Send `payload` as one line over `s` and read the one line of the answer."""
    s.settimeout(timeout_s)
    try:
        try:
            s.sendall(json.dumps(payload).encode() + b"\n")
        except TimeoutError:
            raise
        except OSError as e:
            raise RunnerUnreachable(repr(e)) from None
        buf = bytearray()
        while not buf.endswith(b"\n"):
            # 64 KiB: under glibc's mmap threshold, so a read costs no mmap/mremap/munmap
            chunk = s.recv(1 << 16)
            if not chunk:
                raise RunnerGone("runner closed the connection")
            buf += chunk
    except TimeoutError:
        raise RunnerTimeout(f"no answer in {timeout_s:.1f} s") from None
    except OSError as e:
        raise RunnerGone(repr(e)) from None
    out: dict[str, Any] = json.loads(buf)
    return out


def call_runner(path: Path, payload: dict[str, Any], timeout_s: float, owner_uid: int = 0) -> dict[str, Any]:
    """One request/response with the runner over a connection of its own."""
    s, _ = _connect(path, timeout_s, owner_uid)
    with s:
        return _exchange(s, payload, timeout_s)


class _Kept:
    """The links of this process with an open connection, least recently used first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._links: OrderedDict[RunnerLink, None] = OrderedDict()

    def used(self, link: RunnerLink) -> None:
        """`link` (busy, connected) was just used; close the least recently used idle ones
        past `MAX_KEPT`."""
        over: list[RunnerLink] = []
        with self._lock:
            self._links[link] = None
            self._links.move_to_end(link)
            excess = len(self._links) - MAX_KEPT
            # at most `excess` looked at (usually none): this runs on every request
            for old in list(itertools.islice(self._links, max(0, excess))):
                if old._busy.acquire(blocking=False):  # one in use is left for later
                    del self._links[old]
                    over.append(old)
        for old in over:
            try:
                old._close_socket()
            finally:
                old._busy.release()

    def forget(self, link: RunnerLink) -> None:
        with self._lock:
            self._links.pop(link, None)

    def __len__(self) -> int:
        return len(self._links)


KEPT = _Kept()


class RunnerLink:
    """One kept connection to one sandbox's runner (see the module doc). `owner` is what the
    connection was made for (the backend's sandbox object): a link is used only while its
    handle still holds that sandbox. Requests over one link come one at a time (the handle's
    lock); one that finds the link busy anyway gets a connection of its own."""

    def __init__(self, path: Path, owner: Any, owner_uid: int = 0) -> None:
        self.path = path
        self.owner = owner
        self.owner_uid = owner_uid
        self._sock: socket.socket | None = None
        self._ident = (0, 0)
        self._busy = threading.Lock()

    def call(self, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if not self._busy.acquire(blocking=False):
            return call_runner(self.path, payload, timeout_s, self.owner_uid)
        try:
            if self._sock is None:
                return self._exchange(payload, timeout_s)
            self._check()
            try:
                return self._exchange(payload, timeout_s)
            except RunnerUnreachable:
                # The kept connection was closed at the runner's end: a runner that died (a new
                # connection is refused then) or one that closed it. It reads whole lines, so
                # nothing of the request ran: once more over a new connection.
                return self._exchange(payload, timeout_s)
        finally:
            self._busy.release()

    def _check(self) -> None:
        """The checks `_connect` made, again: the directory still private, the socket still
        the runner's and still the one connected to (by inode)."""
        try:
            if _trusted(self.path, os.lstat(self.path), self.owner_uid) != self._ident:
                raise RunnerUnreachable(f"{self.path.name} is not the socket first connected to")
        except OSError as e:
            self.close()
            raise RunnerUnreachable(repr(e)) from None
        except RunnerUnreachable:
            self.close()
            raise

    def _exchange(self, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """`payload` over the kept connection, made first when there is none; closed on any
        failure, so an answer that comes late is never read as the next request's."""
        try:
            if self._sock is None:
                self._sock, self._ident = _connect(self.path, timeout_s, self.owner_uid)
            out = _exchange(self._sock, payload, timeout_s)
        except BaseException:
            self.close()
            raise
        KEPT.used(self)
        return out

    def close(self) -> None:
        KEPT.forget(self)
        self._close_socket()

    def _close_socket(self) -> None:
        s, self._sock = self._sock, None
        if s is not None:
            s.close()
