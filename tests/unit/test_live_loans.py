"""Core loans carried out live, in memory: the CPU worker's bookkeeping (`workers.loans`), its
handler resizing sandboxes, the pool's resizing of a running action (`sandbox.resize`, with a
fake runner), and the runner's test-case loop taking a new DoP mid-run (a real zygote)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tangram_celery.common.actions import ActionStatus
from tangram_celery.common.config import SandboxConfig
from tangram_celery.common.wire import ActionResult, CoreLoan, TaskOrder
from tangram_celery.sandbox import ExecRequest
from tangram_celery.sandbox.resize import Resizing
from tangram_celery.workers.cpu import CpuHandler
from tangram_celery.workers.loans import CoreLoans
from tangram_runner.control import Control, apply_dop
from tangram_runner.proc import Action, Zygote
from tangram_runner.protocol import RunRequest
from tangram_runner.tests import run_tests
from tests.fixtures.runner import run_request, seat
from tests.unit.test_sandbox_proc import zygote  # noqa: F401  (the fixture)


def loan(aid: str, cores: tuple[int, ...], seq: int) -> CoreLoan:
    return CoreLoan(action_id=aid, pool="n0", cores=cores, seq=seq)


# ---- the worker's bookkeeping ----------------------------------------------------------------------
def test_a_loan_widens_its_borrower_and_an_older_one_arriving_late_is_dropped() -> None:
    """Given a suite running on core 0, a loan of cores 1-2 (seq 2) widens it to 0-2, and the
    loan of seq 1 that arrives after it changes nothing."""
    loans = CoreLoans()
    assert loans.start("s", (0,)) == ((0,), [])
    assert loans.lend(loan("s", (1, 2), 2)) == ["s"]
    assert loans.cores("s") == (0, 1, 2)
    assert loans.lend(loan("s", (1,), 1)) == []
    assert loans.cores("s") == (0, 1, 2)
    assert loans.lend(loan("s", (), 3)) == ["s"] and loans.cores("s") == (0,)


def test_an_action_starting_on_a_lent_core_takes_it_back_first() -> None:
    """Given core 1 lent to suite s, when action a starts on core 1 (its take-back not arrived),
    then s is narrowed to core 0 before a runs, and a later loan of core 1 to s is not honoured
    while a owns it."""
    loans = CoreLoans()
    loans.start("s", (0,))
    loans.lend(loan("s", (1,), 5))
    cores, changed = loans.start("a", (1,))
    assert (cores, changed) == ((1,), ["s"]) and loans.cores("s") == (0,)
    assert loans.lend(loan("s", (1,), 6)) == []
    assert loans.cores("s") == (0,)
    loans.end("a")
    assert loans.cores("a") is None and loans.lend(loan("s", (1,), 7)) == ["s"]


def test_a_core_lent_to_another_borrower_moves_from_the_first() -> None:
    """Given core 2 lent to suite s, when a loan gives core 2 to suite t, then s loses it."""
    loans = CoreLoans()
    loans.start("s", (0,))
    loans.start("t", (1,))
    loans.lend(loan("s", (2, 3), 1))
    assert sorted(loans.lend(loan("t", (2,), 2))) == ["s", "t"]
    assert (loans.cores("s"), loans.cores("t")) == ((0, 3), (1, 2))


def test_a_loan_before_its_action_starts_is_kept_for_it_and_one_after_its_end_is_dropped() -> None:
    """Given a loan for suite s that reaches the worker before s's own message, when s starts,
    then it starts with its lent cores; after s ended, a late loan for it is dropped."""
    loans = CoreLoans()
    assert loans.lend(loan("s", (1,), 1)) == []
    assert loans.start("s", (0,)) == ((0, 1), [])
    loans.end("s")
    assert loans.lend(loan("s", (1,), 2)) == [] and loans.cores("s") is None
    assert loans.start("s2", (0,)) == ((0,), [])


def test_ended_actions_are_forgotten_oldest_first_after_keep_s_or_past_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given ended actions remembered (so that a late loan for one is dropped), when keep_s has
    passed since some ended, or more than MAX_ENDED ended, then the oldest are forgotten first
    and the recent ones still drop their late loans."""
    from tangram_celery.workers import loans as loans_mod

    now = [0.0]
    loans = CoreLoans(keep_s=10.0, clock=lambda: now[0])
    for i in range(3):
        loans.start(f"a{i}", (0,))
        loans.end(f"a{i}")
        now[0] += 4.0  # a0 ended at 0, a1 at 4, a2 at 8
    loans.start("b", (0,))
    loans.end("b")  # at 12: a0 (12 s ago) is forgotten, a1 and a2 are not
    assert list(loans._ended) == ["a1", "a2", "b"]
    assert loans.lend(loan("a2", (1,), 5)) == [] and loans.cores("a2") is None
    monkeypatch.setattr(loans_mod, "MAX_ENDED", 2)
    loans.start("c", (0,))
    loans.end("c")
    assert list(loans._ended) == ["b", "c"]


# ---- the worker's handler ----------------------------------------------------------------------------
class FakeSandbox:
    """Records resizes; its run blocks until released (the action is running meanwhile)."""

    name = "fake"

    def __init__(self) -> None:
        self.resized: list[tuple[str, tuple[int, ...]]] = []
        self.ran: list[tuple[int, ...]] = []
        self.release = threading.Event()

    def resize(self, action_id: str, cores: tuple[int, ...]) -> bool:
        self.resized.append((action_id, cores))
        return True

    def run(self, trajectory_id: str, request: ExecRequest) -> Any:
        self.ran.append(tuple(request.cores))
        self.release.wait(10)
        from tangram_celery.sandbox import ExecResult

        return ExecResult(status=ActionStatus.OK)

    run_once = None


def test_the_handler_resizes_the_borrower_on_a_loan_and_before_an_action_takes_its_core() -> None:
    """Given a CPU handler running suite s on core 0, when a loan of core 1 arrives, then the
    sandbox of s is resized to 0-1; when action a is then given core 1, s is resized back to 0
    before a runs on 1, and s's cores are forgotten when it ends."""
    box = FakeSandbox()
    handler = CpuHandler(box, SandboxConfig(backend="namespace"))  # type: ignore[arg-type]
    payload = {"type": "code", "trajectory_id": "t", "code": "pass"}
    out: list[ActionResult] = []
    th = threading.Thread(target=lambda: out.append(handler("s", payload, TaskOrder(**_order("s", 0)))))
    th.start()
    while not box.ran:
        time.sleep(0.01)
    handler.lend(loan("s", (1,), 1))
    assert box.resized == [("s", (0, 1))]
    box.release.set()
    handler("a", {**payload, "trajectory_id": "u"}, TaskOrder(**_order("a", 1)))
    assert box.resized[1] == ("s", (0,)) and box.ran == [(0,), (1,)]
    th.join(10)
    assert out and out[0].status is ActionStatus.OK and handler.loans.cores("s") is None


def _order(aid: str, core: int) -> dict[str, Any]:
    return {"action_id": aid, "kind": "cpu", "pool": "n0", "units": 1, "unit_ids": (core,)}


# ---- the pool's resizing --------------------------------------------------------------------------------
class Box:
    """A sandbox handle with the fields `Resizing` uses."""

    def __init__(self) -> None:
        self.cores: tuple[int, ...] = ()
        self.memory_mb = 0


def test_resizing_binds_then_tells_the_runner_and_keeps_a_resize_that_came_first() -> None:
    """Given a pool's resizing with a recording bind and a runner that takes the second try, a
    resize before the action starts is what it starts with; a resize while it runs re-binds it
    and is retried until its runner took it; after it ends, nothing is bound or sent."""
    bound: list[tuple[int, ...]] = []
    sent: list[dict[str, Any]] = []
    answers = iter([{"applied": False}, {"applied": True}])

    def bind(h: Any, cores: tuple[int, ...], memory_mb: int) -> None:
        bound.append(cores)

    def call(h: Any, req: dict[str, Any]) -> dict[str, Any]:
        sent.append(req)
        return next(answers)

    rs = Resizing(bind, call)
    h = Box()
    req = ExecRequest(language="python", code="", cores=(0,), action_id="s")
    assert rs.resize("s", (0, 1)) is False  # not running yet: kept for its start
    assert rs.enter(h, req) == (0, 1) and bound == [(0, 1)]  # type: ignore[arg-type]
    assert rs.resize("s", (0, 1, 2)) is True
    assert bound[-1] == (0, 1, 2) and h.cores == (0, 1, 2)
    assert [r["cores"] for r in sent] == [[0, 1, 2], [0, 1, 2]] and sent[0]["key"] == "s"
    rs.leave(req)
    n = len(bound)
    assert rs.resize("s", (0,)) is False and len(bound) == n and len(sent) == 2


# ---- the runner: a new DoP mid-run ------------------------------------------------------------------------
CASE = 'echo "start $(cat) $(date +%s.%N)" >> log; sleep 0.4; echo "end $(date +%s.%N)" >> log; echo ok'


def _suite(n: int, cores: list[int], key: str = "k") -> RunRequest:
    """A request of `n` stdin test cases (each runs `CASE`: logs its start and end, 0.4 s)."""
    return run_request(
        timeout_s=60,
        cores=cores,
        key=key,
        language="bash",
        test_cases=[{"name": f"c{i}", "stdin": str(i), "expected_stdout": "ok"} for i in range(n)],
    )


def _send(path: str, req: dict[str, Any]) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(json.dumps(req).encode() + b"\n")
        out: dict[str, Any] = json.loads(s.makefile().readline())
        return out


def _max_overlap(log: str, after_s: float = 0.0) -> int:
    """Most cases running at once among those that started after `after_s` (epoch s)."""
    edges: list[tuple[float, int]] = []
    starts = [float(line.split()[2]) for line in log.splitlines() if line.startswith("start")]
    ends = [float(line.split()[1]) for line in log.splitlines() if line.startswith("end")]
    for t in starts:
        if t >= after_s:
            edges.append((t, 1))
    for t in ends:
        if t >= after_s:
            edges.append((t, -1))
    best = cur = 0
    for _, d in sorted(edges, key=lambda e: (e[0], e[1])):
        cur += d
        best = max(best, cur)
    return best


@pytest.mark.skipif(os.getuid() != 0, reason="children drop their uid and groups, which needs root")
def test_the_runner_starts_more_cases_after_a_loan_and_fewer_after_a_take_back(
    tmp_path: Path,
    zygote: Zygote,  # noqa: F811  (the fixture of test_sandbox_proc)
) -> None:
    """Given 8 test cases at DoP 1, when the host raises the DoP to 3 over the runner's socket
    while they run, then more cases run at once; when it lowers it to 1, no two cases started
    after that overlap; every case runs once and passes. A request naming another action's key
    changes nothing."""
    work = tmp_path / "work"
    work.mkdir()
    sock_path = str(tmp_path / "ctl.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(sock_path)
    srv.listen(4)
    req = _suite(8, [0])
    act = Action(req, seat(work), zygote)
    control = Control(srv)
    control.attach(act)
    marks: dict[str, float] = {}

    def host() -> None:
        time.sleep(0.6)
        assert _send(sock_path, {"op": "dop", "key": "other", "cores": [0, 1, 2]}) == {"applied": False}
        marks["wide"] = time.time()
        assert _send(sock_path, {"op": "dop", "key": "k", "cores": [0, 1, 2]})["dop"] == 3
        time.sleep(0.9)
        marks["narrow"] = time.time()
        assert _send(sock_path, {"op": "dop", "key": "k", "cores": [0]})["dop"] == 1

    th = threading.Thread(target=host)
    th.start()
    try:
        tests, _ = run_tests(req, act, 1, None, [], ["/bin/sh", "-c", CASE])
    finally:
        th.join(10)
        act.close()
        srv.close()
    log = (work / "log").read_text()
    assert sorted(line.split()[1] for line in log.splitlines() if line.startswith("start")) == [
        str(i) for i in range(8)
    ]
    assert all(t["passed"] for t in tests), tests
    assert _max_overlap(log, 0.0) >= 2  # wider after the loan
    assert _max_overlap(log, marks["narrow"] + 0.05) <= 1  # cases started after the take-back


def test_a_dop_request_needs_the_running_actions_key() -> None:
    """Given a running action with key k, a request without a key or with another key is not
    applied; one with k sets the DoP and the cores new processes pin to."""

    class Act:
        req = run_request(key="k", cores=[0])
        dop = 1

    act = Act()
    assert apply_dop(act, {"cores": [0, 1]}) == {"applied": False}
    assert apply_dop(act, {"key": "x", "cores": [0, 1]}) == {"applied": False}
    assert apply_dop(act, {"key": "k", "cores": [0, 1]}) == {"applied": True, "dop": 2}
    assert act.req.cores == [0, 1] and apply_dop(None, {"key": "k", "cores": [0]}) == {"applied": False}
