"""Core loans carried out for real: a malleable test suite widened and narrowed mid-run.

1. The CPU worker's handler on each sandbox backend (Docker, bubblewrap, built-in launcher):
   the test lends a core to a running suite and takes it back, as the scheduler's messages do.
2. A whole deployment (Redis, scheduler with `tangram-fast`, CPU worker, namespace sandboxes):
   the scheduler decides the loans itself, lending the core a finished action gave back and
   taking it back for the next action.

Each test case logs its start, its end and the cores it may run on (`os.sched_getaffinity`, which
follows the sandbox's cpuset) into the trajectory's workdir; a later action of the trajectory
reads the log. The checks are behaviour, not speed: more cases at once after a loan, none beside
a case started after the take-back, every case once, and the cgroup's cpuset as lent.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import pytest

from tangram_celery.common.actions import CodeAction, TestCase

CASE = """import json, os, sys, time
t0 = time.time()
cores = sorted(os.sched_getaffinity(0))
time.sleep(0.6)
with open("cases.log", "a") as f:
    f.write(json.dumps({"case": sys.stdin.read().strip(), "start": t0, "end": time.time(), "cores": cores}) + "\\n")
print("ok")
"""


def suite(n: int) -> list[TestCase]:
    return [TestCase(name=f"c{i}", stdin=str(i), expected_stdout="ok") for i in range(n)]


def spans(log: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.splitlines() if line.strip()]


def alone(case: dict[str, Any], cases: list[dict[str, Any]], until: float = float("inf")) -> bool:
    """No other case ran while `case` did (up to `until`)."""
    end = min(case["end"], until)
    return all(c is case or c["end"] <= case["start"] or c["start"] >= end for c in cases)


def widest(cases: list[dict[str, Any]]) -> int:
    """Most cases running at once."""
    edges = sorted([(c["start"], 1) for c in cases] + [(c["end"], -1) for c in cases], key=lambda e: e)
    best = cur = 0
    for _, d in edges:
        cur += d
        best = max(best, cur)
    return best


def _cpuset(box: Any, trajectory: str) -> str | None:
    h = box._handles.get(trajectory)
    if h is None or h.cgroups is None:
        return None
    return str((h.cgroups.dirs["cpuset"] / "cpuset.cpus").read_text().strip())


def test_a_running_suite_is_widened_by_a_loan_and_narrowed_by_its_take_back(sandbox_backend: Any) -> None:
    """Given a CPU worker's handler running a suite of 10 cases on core 0 in a warm sandbox, when
    core 1 is lent to it (a CoreLoan), then its cgroup's cpuset becomes 0-1 and cases run two at
    once on cores [0, 1]; when the loan is taken back, the cpuset is 0 again and no case started
    after that runs beside another; every case ran once and passed."""
    from tangram_celery.common.config import SandboxConfig
    from tangram_celery.common.wire import CoreLoan, TaskOrder
    from tangram_celery.workers.cpu import CpuHandler

    handler = CpuHandler(sandbox_backend, SandboxConfig(backend="namespace"))
    traj = "loan-" + uuid.uuid4().hex[:8]

    def order(aid: str, cores: tuple[int, ...]) -> TaskOrder:
        return TaskOrder(action_id=aid, kind="cpu", pool="n0", units=len(cores), unit_ids=cores)

    def payload(**kw: Any) -> dict[str, Any]:
        return CodeAction(trajectory_id=traj, timeout_s=60, **kw).model_dump(mode="json")

    warm = handler("w", payload(language="bash", code="true"), order("w", (0,)))
    assert warm.status == "ok", warm
    out: list[Any] = []
    cases = suite(10)
    run = threading.Thread(
        target=lambda: out.append(handler("s", payload(code=CASE, test_cases=cases), order("s", (0,))))
    )
    run.start()
    time.sleep(1.0)
    handler.lend(CoreLoan(action_id="s", pool="n0", cores=(1,), seq=1))
    widened = time.time()
    wide_set = _cpuset(sandbox_backend, traj)
    time.sleep(1.5)
    handler.lend(CoreLoan(action_id="s", pool="n0", cores=(), seq=2))
    narrowed = time.time()
    narrow_set = _cpuset(sandbox_backend, traj)
    run.join(60)
    [res] = out
    assert res.status == "ok" and [t.passed for t in res.tests] == [True] * 10, res
    log = handler("r", payload(language="bash", code="cat cases.log"), order("r", (0,)))
    got = spans(log.stdout)
    assert sorted(int(c["case"]) for c in got) == list(range(10)), "each case ran once"
    if wide_set is not None:  # the rlimit fallback has no cgroup to read
        assert (wide_set, narrow_set) == ("0-1", "0")
    during = [c for c in got if widened <= c["start"] < narrowed]
    assert any(c["cores"] == [0, 1] for c in during), got
    assert widest(got) == 2, got
    after = [c for c in got if c["start"] > narrowed + 0.05]
    assert after and all(c["cores"] == [0] and alone(c, got) for c in after), got
    assert all(c["cores"] == [0] for c in got if c["start"] < widened - 0.05)
    assert handler.loans.cores("s") is None


@pytest.mark.deploy(
    sandbox={"backend": "namespace", "default_timeout_s": 60},
    scheduler={
        "policy": "tangram-fast",
        "check_invariants": True,
        # a long prior for plain code: the suite starts on the free core, rather than waiting
        # for the blocker's core (it would, were the blocker expected to end soon)
        "priors": {"code": {"t1_s": 100.0}, "tests": {"t1_s": 10.0, "parallel_fraction": 0.95}},
    },
)
def test_the_scheduler_lends_a_freed_core_to_a_running_suite_and_takes_it_back(client: Any) -> None:
    """Given a 2-core node with a 3 s action on one core and a suite of 16 cases (cpus 1..2)
    started on the other, when the 3 s action ends and nothing waits, then the scheduler lends
    its core to the suite (cases run two at once on both cores); when a new 2 s action comes,
    it gets that core and no suite case started during it runs beside another or on its core;
    after it, the suite widens again. Every case ran once and passed."""
    blocker = client.submit(CodeAction(trajectory_id="blk", code="import time; time.sleep(3)", timeout_s=60))
    _wait_running(client, blocker.id)
    s = client.submit(
        CodeAction(trajectory_id="suite", code=CASE, test_cases=suite(16), cpus="1..2", timeout_s=120)
    )
    assert blocker.result(timeout=60).status == "ok"
    time.sleep(1.2)  # the loan: the freed core goes to the suite
    probe = "import json, os, time; t0 = time.time(); c = sorted(os.sched_getaffinity(0)); time.sleep(2); "
    probe += 'print(json.dumps({"start": t0, "end": time.time(), "cores": c}))'
    other = client.submit(CodeAction(trajectory_id="other", code=probe, timeout_s=60)).result(timeout=60)
    res = s.result(timeout=120)
    assert other.status == "ok" and res.status == "ok", (other, res)
    assert [t.passed for t in res.tests] == [True] * 16, res.tests
    log = client.submit(CodeAction(trajectory_id="suite", language="bash", code="cat cases.log")).result(
        timeout=60
    )
    got = spans(log.stdout)
    assert sorted(int(c["case"]) for c in got) == list(range(16)), "each case ran once"
    span = json.loads(other.stdout)
    [core] = span["cores"]
    before = [c for c in got if c["start"] < span["start"]]
    assert widest(before) == 2 and any(len(c["cores"]) == 2 for c in before), got
    during = [c for c in got if span["start"] + 0.05 < c["start"] < span["end"]]
    # (once it ends, its core is lent again: a case may then join one started during it)
    assert during and all(c["cores"] == [1 - core] and alone(c, got, span["end"]) for c in during), (
        span,
        got,
    )
    after = [c for c in got if c["start"] > span["end"] + 0.3]
    assert not after or any(len(c["cores"]) == 2 for c in after), (span, got)


def _wait_running(client: Any, action_id: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while client.store.action_state(action_id) != "running":
        assert time.monotonic() < deadline, "the action never started"
        time.sleep(0.05)
