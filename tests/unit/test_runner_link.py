"""The host's kept connection to a sandbox's runner (`tangram_celery.sandbox.link.RunnerLink`),
against a runner stand-in that speaks the runner's protocol (one JSON line per request, answered
on the same connection, kept open until the host closes it) in a root-private directory."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tangram_celery.sandbox import link as link_module
from tangram_celery.sandbox.link import RunnerLink, RunnerTimeout, RunnerUnreachable

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the runner's socket must be root's: run as root"),
]


class StandIn:
    """Answers each request line with the number of connections accepted so far and the
    request's own `n`; `{"sleep": s}` waits s seconds first; `{"hang_up": true}` closes that
    connection after answering."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.srv = socket.socket(socket.AF_UNIX)
        self.srv.bind(str(path))
        os.chmod(path, 0o600)
        self.srv.listen(8)
        self.accepted = 0
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self.accepted += 1
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while True:
                try:
                    chunk = conn.recv(1 << 16)
                except OSError:
                    return
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    req = json.loads(line)
                    time.sleep(req.get("sleep", 0))
                    try:
                        conn.sendall(json.dumps({"n": req["n"], "accepted": self.accepted}).encode() + b"\n")
                    except OSError:
                        return
                    if req.get("hang_up"):
                        return

    def close(self) -> None:
        try:
            self.srv.shutdown(socket.SHUT_RDWR)  # wakes the accept, which then ends
        except OSError:
            pass
        self.srv.close()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture()
def runner_dir(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    return d


def test_a_link_keeps_one_connection_for_its_requests(runner_dir: Path) -> None:
    """Given a link, when it sends three requests one after the other, then all three go over
    one connection and each gets its own answer."""
    runner = StandIn(runner_dir / "runner.sock")
    link = RunnerLink(runner_dir / "runner.sock", owner=None)
    try:
        assert [link.call({"n": i}, 5.0)["n"] for i in range(3)] == [0, 1, 2]
        assert runner.accepted == 1
    finally:
        link.close()
        runner.close()


@pytest.mark.parametrize("tamper", ["socket-replaced", "directory-handed-over"])
def test_a_link_refuses_what_it_would_not_have_connected_to(runner_dir: Path, tamper: str) -> None:
    """Given a link that has talked to the runner, when the runner's socket is replaced by
    another (root's too, but not the one connected to) or its directory handed to the sandbox
    uid, then the next request is refused as unreachable (nothing of it sent anywhere), as a new
    connection would have been."""
    path = runner_dir / "runner.sock"
    runner = StandIn(path)
    link = RunnerLink(path, owner=None)
    other = None
    try:
        assert link.call({"n": 1}, 5.0)["n"] == 1
        if tamper == "socket-replaced":
            os.unlink(path)
            other = StandIn(path)
        else:
            os.chown(runner_dir, 10001, 10001)
        with pytest.raises(RunnerUnreachable):
            link.call({"n": 2}, 5.0)
        assert runner.accepted == 1 and (other is None or other.accepted == 0)
    finally:
        link.close()
        runner.close()
        if other is not None:
            other.close()


def test_a_late_answer_is_never_read_as_the_next_ones(runner_dir: Path) -> None:
    """Given a request that timed out, when the link's next request is answered, then the
    answer is that request's, not the late one of the request before (over a new connection)."""
    runner = StandIn(runner_dir / "runner.sock")
    link = RunnerLink(runner_dir / "runner.sock", owner=None)
    try:
        with pytest.raises(RunnerTimeout):
            link.call({"n": 1, "sleep": 0.4}, 0.1)
        time.sleep(0.5)  # the late answer has been sent by now
        assert link.call({"n": 2}, 5.0) == {"n": 2, "accepted": 2}
    finally:
        link.close()
        runner.close()


def test_a_connection_the_runner_closed_is_made_again(runner_dir: Path) -> None:
    """Given a runner that closed the kept connection after answering, when the link sends its
    next request, then it goes over a new connection and is answered (nothing of it had been
    read by the runner, so sending it again runs it once)."""
    runner = StandIn(runner_dir / "runner.sock")
    link = RunnerLink(runner_dir / "runner.sock", owner=None)
    try:
        assert link.call({"n": 1, "hang_up": True}, 5.0)["n"] == 1
        time.sleep(0.1)
        assert link.call({"n": 2}, 5.0) == {"n": 2, "accepted": 2}
    finally:
        link.close()
        runner.close()


def test_a_dead_runner_is_unreachable_over_a_kept_link(runner_dir: Path) -> None:
    """Given a link to a runner that has since died (its sockets closed), when the link sends a
    request, then it is unreachable: the caller may run it elsewhere."""
    runner = StandIn(runner_dir / "runner.sock")
    link = RunnerLink(runner_dir / "runner.sock", owner=None)
    try:
        assert link.call({"n": 1}, 5.0)["n"] == 1
        runner.close()
        time.sleep(0.1)
        with pytest.raises(RunnerUnreachable):
            link.call({"n": 2}, 5.0)
    finally:
        link.close()


def test_requests_that_meet_on_one_link_each_get_their_own_answer(runner_dir: Path) -> None:
    """Given a request in flight on a link, when another thread sends one over the same link,
    then that one goes over a connection of its own and each gets its own answer."""
    runner = StandIn(runner_dir / "runner.sock")
    link = RunnerLink(runner_dir / "runner.sock", owner=None)
    out: dict[str, Any] = {}
    try:
        link.call({"n": 0}, 5.0)
        slow = threading.Thread(target=lambda: out.update(slow=link.call({"n": 1, "sleep": 0.4}, 5.0)))
        slow.start()
        time.sleep(0.1)
        out["fast"] = link.call({"n": 2}, 5.0)
        slow.join()
        assert (out["slow"]["n"], out["fast"]["n"], runner.accepted) == (1, 2, 2)
        assert link.call({"n": 3}, 5.0) == {"n": 3, "accepted": 2}  # the kept one again
    finally:
        link.close()
        runner.close()


def test_a_process_keeps_at_most_max_kept_connections(
    runner_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a cap of two kept connections, when three links are used in turn, then the one
    used longest ago is closed (its runner sees the end) unless a request is in flight on it,
    and its next request makes a new connection."""
    monkeypatch.setattr(link_module, "MAX_KEPT", 2)
    runner = StandIn(runner_dir / "runner.sock")
    links = [RunnerLink(runner_dir / "runner.sock", owner=None) for _ in range(4)]
    try:
        for i in range(3):
            links[i].call({"n": i}, 5.0)
        assert [lk._sock is not None for lk in links[:3]] == [False, True, True]
        assert links[0].call({"n": 0}, 5.0) == {"n": 0, "accepted": 4}  # made again: 1 closed
        assert links[1]._sock is None
        with links[2]._busy:  # in use (a request in flight): not closed under it
            links[3].call({"n": 3}, 5.0)
            assert links[2]._sock is not None and links[0]._sock is not None
    finally:
        for lk in links:
            lk.close()
        runner.close()
    assert len(link_module.KEPT) == 0
