"""The runner's verdict on a pytest suite, from what reaches its report channel."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from tangram_runner.suite import Channel, verdict


@pytest.fixture
def channel() -> Iterator[Channel]:
    ch = Channel()
    yield ch
    ch.close()


def session(ch: Channel) -> tuple[socket.socket, str]:
    """A reporter's end of the channel, after its hello."""
    s = socket.socket(fileno=os.dup(ch.child_fd))
    s.send(b"hello")
    ch.on_readable()
    return s, s.recv(64).decode()


def send(ch: Channel, s: socket.socket, nonce: str, *events: dict[str, Any]) -> None:
    for ev in events:
        s.send(json.dumps({"nonce": nonce, **ev}).encode())
    ch.on_readable()


def report(nodeid: str, outcome: str, when: str = "call", xfail: bool = False) -> dict[str, Any]:
    return {"event": "report", "nodeid": nodeid, "when": when, "outcome": outcome, "xfail": xfail}


def passing_run(n: int = 2) -> list[dict[str, Any]]:
    evs: list[dict[str, Any]] = [{"event": "collected", "n": n}]
    for i in range(n):
        evs += [
            report(f"t::{i}", "passed", "setup"),
            report(f"t::{i}", "passed"),
            report(f"t::{i}", "passed", "teardown"),
        ]
    return [*evs, {"event": "finish", "exitstatus": 0}]


def test_complete_passing_reports_pass(channel: Channel) -> None:
    """Given a session that collected 2 tests, reported both passed and finished 0, then passed."""
    s, nonce = session(channel)
    send(channel, s, nonce, *passing_run())
    v = verdict(channel, 0)
    assert v["passed"] and v["collected"] == 2 and [t["passed"] for t in v["tests"]] == [True, True]
    s.close()


@pytest.mark.parametrize(
    ("events", "exit_code", "why"),
    [
        (None, 0, "no pytest report"),
        (passing_run()[:-1], 0, "without its final report"),
        ([{"event": "collected", "n": 0}, {"event": "finish", "exitstatus": 5}], 0, "no test was collected"),
        ([*passing_run(2)[:4], {"event": "finish", "exitstatus": 0}], 0, "1 of 2"),
        (
            [
                {"event": "collected", "n": 1},
                report("t::0", "skipped", "setup"),
                {"event": "finish", "exitstatus": 0},
            ],
            0,
            "0 of 1",
        ),
        (
            [
                {"event": "collected", "n": 1},
                report("t::0", "skipped", xfail=True),
                {"event": "finish", "exitstatus": 0},
            ],
            0,
            "0 of 1",
        ),
        (
            [
                {"event": "collected", "n": 1},
                report("t::0", "passed"),
                report("t::0", "failed", "teardown"),
                {"event": "finish", "exitstatus": 1},
            ],
            1,
            "0 of 1",
        ),
        ([{"event": "collect_error", "nodeid": "t.py"}, *passing_run(1)], 0, "collection errors"),
        (passing_run(), 3, "exited with 3"),
    ],
    ids=[
        "nothing",
        "no-finish",
        "none-collected",
        "missing-report",
        "skipped",
        "xfail",
        "teardown-error",
        "collect-error",
        "command-exit",
    ],
)
def test_incomplete_or_failing_reports_do_not_pass(
    channel: Channel, events: list[dict[str, Any]] | None, exit_code: int, why: str
) -> None:
    """Given reports that miss a piece (no session, no finish, nothing collected, a test without
    a passing call, a skip or xfail, a failing teardown, a collection error) or a failing
    command, then not passed, saying why."""
    if events is not None:
        s, nonce = session(channel)
        send(channel, s, nonce, *events)
        s.close()
    v = verdict(channel, exit_code)
    assert not v["passed"] and why in v["detail"], v


def test_messages_without_a_known_nonce_are_ignored(channel: Channel) -> None:
    """Given a real session that fails and forged passing reports under other nonces (or none),
    when judged, then the forged reports count for nothing."""
    s, nonce = session(channel)
    send(
        channel,
        s,
        nonce,
        {"event": "collected", "n": 1},
        report("t::0", "failed"),
        {"event": "finish", "exitstatus": 1},
    )
    for fake in ("", "0" * 32, nonce[:-1] + "x"):
        send(channel, s, fake, *passing_run(1))
    v = verdict(channel, 0)
    assert not v["passed"] and v["tests"] == [{"name": "t::0", "passed": False, "detail": "failed in call"}]
    s.close()


def test_every_session_must_pass(channel: Channel) -> None:
    """Given two pytest sessions in one command, one passing and one not finished, then not passed;
    deselected tests are counted."""
    a, na = session(channel)
    send(channel, a, na, {"event": "deselected", "n": 3}, *passing_run())
    b, nb = session(channel)
    send(channel, b, nb, {"event": "collected", "n": 1})
    v = verdict(channel, 0)
    assert not v["passed"] and v["deselected"] == 3
    a.close()
    b.close()
