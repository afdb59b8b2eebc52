"""End to end on real processes: client -> Redis -> scheduler -> Celery queues -> workers."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

from tangram_celery import ActionRejected, ActionStatus, ApiAction, CodeAction, TestCase
from tests.integration.conftest import RECORD_API

CALC_AND_RECORD = [
    {"name": "calc", "handler": "tangram_celery.apis.builtin:calculator", "max_concurrency": 4},
    RECORD_API,
]
FLAKY_API = {**RECORD_API, "name": "flaky", "handler": "tests.integration.support:flaky"}


def test_code_action_runs_in_sandbox_and_returns(client) -> None:
    """Given a trajectory, when it runs code then a test suite, then stdout, per-test outcomes and
    timings come back, and files written by one action are there for the next."""
    run = client.submit(
        CodeAction(
            trajectory_id="t1",
            code="def add(a, b):\n    return a + b\nopen('add.py', 'w').write('def add(a, b):\\n    return a + b\\n')\nprint(add(2, 3))\n",
        )
    ).result(timeout=120)
    assert run.status is ActionStatus.OK, run
    assert run.stdout.strip() == "5"
    assert run.act_s >= run.exec_s > 0 and run.node == "n0" and run.units == 1
    tests = client.submit(
        CodeAction(
            trajectory_id="t1",
            code="from add import add\n",
            test_cases=[
                TestCase(name="small", assert_code="assert add(1, 2) == 3"),
                TestCase(name="neg", assert_code="assert add(-1, -2) == -3"),
                TestCase(name="wrong", assert_code="assert add(1, 1) == 3"),
            ],
            cpus="1..2",
        )
    ).result(timeout=120)
    assert tests.status is ActionStatus.FAILED, tests
    assert [(t.name, t.passed) for t in tests.tests] == [("small", True), ("neg", True), ("wrong", False)]
    assert 1 <= tests.units <= 2


def test_200_concurrent_actions_over_20_trajectories(client) -> None:
    """Given 200 code actions over 20 trajectories, all complete with the right output."""
    actions = [
        # 20 trajectories x 128 MiB fit the node's 4 GiB, so all of them are placed at once.
        CodeAction(
            trajectory_id=f"traj-{i % 20}", code=f"print(sum(range({i})))", memory_mb=128, timeout_s=60
        )
        for i in range(200)
    ]
    handles = client.submit_many(actions)
    results = [h.result(timeout=600) for h in handles]
    statuses = Counter(r.status for r in results)
    assert statuses == {ActionStatus.OK: 200}, statuses
    for i, r in enumerate(results):
        assert r.stdout.strip() == str(sum(range(i)))


@pytest.mark.deploy(apis=CALC_AND_RECORD, nodes={"cpu": []})
def test_bad_input_is_rejected_and_nothing_enqueued(deployment, client) -> None:
    """Invalid actions raise at submit; the intake and the action store stay empty."""
    r = redis.Redis.from_url(deployment.url)
    good = ApiAction(trajectory_id="t", api="calc", request={"expr": "1+1"})
    bad = [
        {"type": "code", "trajectory_id": "t", "cpus": "9..1", "code": "x"},
        {"type": "teleport", "trajectory_id": "t"},
        ApiAction(trajectory_id="t", api="no-such-api"),
        CodeAction(trajectory_id="t", code="x", cpus=64),
    ]
    for b in bad:
        with pytest.raises(ActionRejected):
            client.submit_many([good, b])  # one bad action refuses the whole batch
    assert r.xlen("tangram:intake") == 0
    assert not list(r.scan_iter("tangram:a:*"))
    with pytest.raises(ActionRejected, match="twice"):
        client.submit_many([good, good])
    assert client.submit(good).result(timeout=60).output == {"value": 2}


@pytest.mark.deploy(apis=[FLAKY_API], nodes={"cpu": []})
def test_retryable_infrastructure_failures_are_placed_again_within_a_bound(client, tmp_path: Path) -> None:
    """Given a handler that fails with a retryable infrastructure error (what a reward worker
    raises when Triton crashed mid-batch), when actions hit it, then the worker hands them back,
    the scheduler places them again and each completes once, on its second attempt; one that
    keeps failing ends as `error` after the attempt bound (5), and is executed no more."""
    log = tmp_path / "executions.log"
    n = 6
    handles = client.submit_many(
        ApiAction(trajectory_id=f"t{i}", api="flaky", request={"tag": i, "log": str(log)}) for i in range(n)
    )
    hopeless = client.submit(
        ApiAction(trajectory_id="tx", api="flaky", request={"tag": 99, "log": str(log), "fail_times": 100})
    )
    results = [h.result(timeout=120) for h in handles]
    last = hopeless.result(timeout=120)
    executed = Counter(int(x) for x in log.read_text().split())
    tries = Counter(int(x) for x in Path(str(log) + ".tries").read_text().split())
    print(f"submitted={n + 1} ok={sum(r.ok for r in results)} tries={dict(tries)} hopeless={last.status}")
    assert all(r.status is ActionStatus.OK and r.attempts == 2 for r in results), results
    assert executed == Counter(range(n)), "each succeeded exactly once"
    assert last.status is ActionStatus.ERROR and "attempt" in (last.error or ""), last
    assert tries[99] == 5


@pytest.mark.deploy(apis=CALC_AND_RECORD, nodes={"cpu": []})
def test_scheduler_killed_mid_run_loses_nothing(deployment, client, tmp_path: Path) -> None:
    """Given a burst in flight, when the scheduler is SIGKILLed and restarted, every action
    completes exactly once."""
    log = tmp_path / "executions.log"
    n = 300
    actions = [
        ApiAction(trajectory_id=f"t{i % 10}", api="rec", request={"tag": i, "log": str(log), "sleep_s": 0.01})
        for i in range(n)
    ]
    handles = client.submit_many(actions)
    time.sleep(0.3)  # some dispatched, some running, most still queued
    deployment.kill("scheduler")  # the deployment's supervisor starts a new one
    results = [h.result(timeout=300) for h in handles]
    executed = Counter(int(x) for x in log.read_text().split())
    print(f"submitted={n} completed={len(results)} executed={sum(executed.values())}")
    assert all(r.status is ActionStatus.OK for r in results)
    assert sorted(executed) == list(range(n)), "an action was lost"
    assert max(executed.values()) == 1, "an action ran twice"


def recorded_burst(client: Any, log: Path, n: int, trajectories: int = 8, sleep_s: float = 0.02) -> list[Any]:
    """`n` actions of the recording API over `trajectories` trajectories, each sleeping
    `sleep_s` and appending its tag to `log` when it executes (so a test can count executions)."""
    return client.submit_many(
        ApiAction(
            trajectory_id=f"t{i % trajectories}",
            api="rec",
            request={"tag": i, "log": str(log), "sleep_s": sleep_s},
        )
        for i in range(n)
    )


@pytest.mark.deploy(apis=CALC_AND_RECORD, nodes={"cpu": []})
def test_worker_killed_mid_action_is_retried(deployment, client, tmp_path: Path) -> None:
    """Given actions running on a worker, when it is SIGKILLed and restarted, every action
    completes exactly once from the client's view, with attempt 2 for the interrupted ones."""
    log = tmp_path / "executions.log"
    n = 12
    handles = recorded_burst(client, log, n, trajectories=n, sleep_s=1.0)
    time.sleep(0.5)  # the first four are mid-sleep on the worker
    deployment.kill("worker-api-rec")  # the deployment's supervisor starts a new one
    results = [h.result(timeout=180) for h in handles]
    executed = Counter(int(x) for x in log.read_text().split())
    retried = [r for r in results if r.attempts > 1]
    print(
        f"submitted={n} completed={len(results)} retried={len(retried)} executions={sum(executed.values())}"
    )
    assert all(r.status is ActionStatus.OK for r in results)
    assert sorted(executed) == list(range(n))
    assert retried, "the interrupted actions should have been retried"


@pytest.mark.deploy(apis=CALC_AND_RECORD, nodes={"cpu": []})
def test_redis_killed_and_restarted_loses_nothing(deployment, client, tmp_path: Path) -> None:
    """Given a burst in flight, when Redis is SIGKILLed and restarted from its AOF, every action
    completes exactly once and the scheduler and workers carry on."""
    log = tmp_path / "executions.log"
    n = 200
    handles = recorded_burst(client, log, n)
    time.sleep(0.5)
    deployment.redis.kill()
    time.sleep(1.0)
    deployment.redis.restart()
    results = [h.result(timeout=300) for h in handles]
    executed = Counter(int(x) for x in log.read_text().split())
    print(f"submitted={n} completed={len(results)} executions={sum(executed.values())}")
    assert all(r.status is ActionStatus.OK for r in results)
    assert sorted(executed) == list(range(n)), "an action was lost"
    # No worker stopped on the way (kombu's close of a lost connection used to stop the one
    # holding unacknowledged messages: tangram_celery/transport/kombu_redis.py).
    restarted = {name: len(c.restarts) for name, c in deployment.children.items() if c.restarts}
    assert not restarted, restarted
    # And the system still serves new work.
    assert client.submit(ApiAction(trajectory_id="after", api="calc", request={"expr": "6*7"})).result(
        timeout=120
    ).output == {"value": 42}


@pytest.mark.deploy(apis=CALC_AND_RECORD, nodes={"cpu": []})
def test_an_embedded_redis_that_dies_is_started_again(deployment, client, tmp_path: Path) -> None:
    """Given a burst in flight, when the embedded Redis dies on its own (SIGKILLed by something
    else than the deployment, as the OOM killer would), then the deployment's supervisor starts
    it again on the same port, password and data within seconds, and every action completes
    exactly once: nothing waits for a server nobody starts."""
    log = tmp_path / "executions.log"
    n = 100
    handles = recorded_burst(client, log, n)
    time.sleep(0.5)
    dead = deployment.redis.proc.pid
    os.kill(dead, signal.SIGKILL)  # the wrapper exec'd redis-server: this is the server
    deadline = time.monotonic() + 30
    while deployment.redis.proc.pid == dead or deployment.redis.proc.poll() is not None:
        assert time.monotonic() < deadline, "the embedded Redis was not started again"
        time.sleep(0.1)
    results = [h.result(timeout=300) for h in handles]
    executed = Counter(int(x) for x in log.read_text().split())
    assert all(r.status is ActionStatus.OK for r in results)
    assert sorted(executed) == list(range(n)), "an action was lost"
    assert max(executed.values()) == 1, "an action ran twice"
    assert client.submit(ApiAction(trajectory_id="after", api="calc", request={"expr": "6*7"})).result(
        timeout=120
    ).output == {"value": 42}


def test_a_redis_restart_keeps_the_cpu_worker_and_its_sandboxes(deployment, client) -> None:
    """Given a CPU action running (its Celery message not yet acknowledged: late acks) when
    Redis is SIGKILLed and restarted from its AOF, then the CPU worker does not stop (kombu's
    close of the lost connection used to stop it: tangram_celery/transport/kombu_redis.py), the action
    completes once, and the trajectory keeps its sandbox: its files are there and nothing says
    `sandbox_reset`."""
    tid = "keeps-its-files"
    first = client.submit(CodeAction(trajectory_id=tid, code="open('/work/mark', 'w').write('kept')"))
    assert first.result(timeout=120).ok
    slow = client.submit(
        CodeAction(trajectory_id=tid, code="import time; time.sleep(4); print(open('/work/mark').read())")
    )
    deadline = time.monotonic() + 60
    while client.store.action_state(slow.id) != "running":
        assert time.monotonic() < deadline, "the action never started"
        time.sleep(0.05)
    deployment.redis.kill()
    time.sleep(1.0)
    deployment.redis.restart()
    res = slow.result(timeout=300)
    assert res.ok and res.stdout.strip() == "kept" and not res.sandbox_reset, res
    after = client.submit(CodeAction(trajectory_id=tid, code="print(open('/work/mark').read())"))
    again = after.result(timeout=120)
    assert again.stdout.strip() == "kept" and not again.sandbox_reset, again
    restarted = {name: len(c.restarts) for name, c in deployment.children.items() if c.restarts}
    assert not restarted, restarted


@pytest.mark.deploy(apis=CALC_AND_RECORD, nodes={"cpu": []})
def test_a_new_client_rides_out_a_redis_restart(deployment) -> None:
    """Given Redis down, when a client that has read nothing yet submits (it first reads the
    published pools and the workers' languages) and waits, then it retries until Redis is back
    instead of raising, and its action completes. (A soak's trajectory thread died of exactly
    that: the languages read had no retry.)"""
    import threading

    from tangram_celery import TangramClient

    out: dict[str, Any] = {}

    def use() -> None:
        try:
            with TangramClient(deployment.url) as c:
                h = c.submit(ApiAction(trajectory_id="late", api="calc", request={"expr": "6*7"}))
                out["state"] = h.client.store.action_state(h.id)
                out["result"] = h.result(timeout=120)
        except BaseException as e:  # what the caller would have seen
            out["error"] = e

    deployment.redis.kill()
    user = threading.Thread(target=use)
    try:
        user.start()
        time.sleep(1.5)
        assert user.is_alive() and not out, out  # waiting for Redis, not failed
    finally:
        deployment.redis.restart()
    user.join(180)
    assert "error" not in out, out
    assert out["state"] in ("queued", "dispatched", "running", "done"), out
    assert out["result"].output == {"value": 42}


def test_a_client_of_the_last_run_carries_on_after_tangram_up_restarts(tmp_path: Path) -> None:
    """Given a client connected to a running stack (embedded Redis), when the whole stack is
    stopped and started again over the same state directory, then the broker comes back on the
    same URL (port and password of the last run), and the same client object, never recreated,
    submits and gets results again; an action it submitted while the stack was down completes
    too. (Before, the new embedded Redis took a new port and password: every trainer holding a
    client retried against the old address forever.)"""
    import threading

    from tangram_celery import TangramClient
    from tangram_celery.common.config import load_config
    from tangram_celery.deploy import Deployment
    from tests.fixtures.redis import deployment_config

    path = deployment_config(tmp_path, nodes={"cpu": []}, apis=CALC_AND_RECORD)
    first = Deployment(load_config(path), path, with_flower=False, with_http=False)
    first.start(progress=False)
    client = TangramClient(first.url)
    try:
        ask = ApiAction(trajectory_id="t", api="calc", request={"expr": "6*7"})
        assert client.submit(ask).result(timeout=60).output == {"value": 42}
        url = first.url
        first.stop()
        out: dict[str, Any] = {}

        def while_down() -> None:  # the caller does not know the stack is down
            try:
                act = ApiAction(trajectory_id="t", api="calc", request={"expr": "2*3"})
                out["result"] = client.submit(act).result(timeout=120)
            except BaseException as e:
                out["error"] = e

        user = threading.Thread(target=while_down)
        user.start()
        second = Deployment(load_config(path), path, with_flower=False, with_http=False)
        try:
            time.sleep(1.0)
            second.start(progress=False)
            assert second.url == url
            user.join(150)
            assert "error" not in out, out
            assert out["result"].output == {"value": 6}
            again = ApiAction(trajectory_id="t", api="calc", request={"expr": "1+1"})
            assert client.submit(again).result(timeout=60).output == {"value": 2}
        finally:
            second.stop()
    finally:
        client.close()
        first.stop()


def test_a_flower_that_dies_is_started_again(tmp_path: Path) -> None:
    """Given `tangram up` with Flower, when Flower is SIGKILLed, then the supervisor starts it
    again on the same URL with the same credentials (an operator's open dashboard keeps
    working)."""
    import base64
    import urllib.error
    import urllib.request

    from tangram_celery.common.config import load_config
    from tangram_celery.deploy import Deployment
    from tests.fixtures.redis import deployment_config

    path = deployment_config(tmp_path, nodes={"cpu": []}, apis=CALC_AND_RECORD, flower={"port": 0})
    dep = Deployment(load_config(path), path, with_flower=True, with_http=False)

    def status(auth: bool) -> int:
        req = urllib.request.Request(dep.flower_url + "/workers")
        if auth:
            token = base64.b64encode(":".join(dep.flower_auth).encode()).decode()
            req.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except OSError:
            return 0

    def wait_for(code: int) -> None:
        deadline = time.monotonic() + 90
        while status(True) != code:
            assert time.monotonic() < deadline, f"Flower did not answer {code} on {dep.flower_url}"
            time.sleep(0.3)

    try:
        dep.start(progress=False)
        wait_for(200)
        old = dep.kill("flower")
        deadline = time.monotonic() + 30
        while dep.children["flower"].proc.pid == old:
            assert time.monotonic() < deadline, "Flower was not started again"
            time.sleep(0.1)
        wait_for(200)
        assert status(False) == 401
    finally:
        dep.stop()


@pytest.mark.deploy(sandbox={"backend": "namespace", "default_timeout_s": 20, "disk_quota_mb": 16})
def test_a_result_says_what_the_sandbox_did_and_what_failed(deployment, client) -> None:
    """Given a trajectory with a file, when an action fills the disk quota, then its result
    (through the client) is `disk_limit` and its `detail` names the file the roll-back removed;
    when the sandbox's runner is killed under a running action (an OOM kill, an operator), the
    result is `error`, its `error` says the runner was lost and `sandbox_reset` is set, and
    the next action runs in a fresh sandbox."""
    from tangram_celery.sandbox.namespace import bwrap_path

    if os.geteuid() != 0 or bwrap_path() is None:
        pytest.skip("the namespace sandbox needs root and bubblewrap")
    keep = CodeAction(trajectory_id="full", code="open('/work/keep.txt', 'w').write('k')")
    assert client.submit(keep).result(timeout=120).ok
    fill = "i = 0\nwhile True:\n    open(f'/work/big{i}', 'w').write('y' * (1 << 20))\n    i += 1\n"
    res = client.submit(CodeAction(trajectory_id="full", code=fill)).result(timeout=120)
    assert res.status is ActionStatus.DISK_LIMIT, res
    assert "removed" in res.detail and "/work/big" in res.detail and "keep.txt" not in res.detail, res.detail

    slow = client.submit(CodeAction(trajectory_id="lost", code="import time; time.sleep(15)"))
    deadline = time.monotonic() + 60
    while client.store.action_state(slow.id) != "running":
        assert time.monotonic() < deadline, "the action never started"
        time.sleep(0.05)
    time.sleep(0.5)
    from tangram_celery.sandbox.limits import SANDBOX_UID
    from tests.integration.lifecycle_support import descendants, is_sandbox_runner, status_field

    # the runner of the sandbox the action runs in: the one with a user process under it (the
    # ready sandboxes' runners are left alone)
    worker = deployment.children["worker-cpu-n0"].proc.pid
    killed = 0
    for pid, _ in descendants(worker):
        if is_sandbox_runner(pid) and any(
            status_field(p, "Uid")[:1] == [str(SANDBOX_UID)] for p, _ in descendants(pid)
        ):
            os.kill(pid, signal.SIGKILL)
            killed += 1
    assert killed == 1, killed
    lost = slow.result(timeout=120)
    assert lost.status is ActionStatus.ERROR and "runner lost" in lost.error, lost
    assert lost.sandbox_reset and lost.detail == lost.error, lost
    after = client.submit(CodeAction(trajectory_id="lost", code="print('again')")).result(timeout=120)
    assert after.ok and after.stdout == "again\n", after


@pytest.mark.deploy(nodes={"cpu": []}, apis=CALC_AND_RECORD)
def test_without_flower_workers_send_task_events_only_once_a_monitor_enables_them(deployment, client) -> None:
    """Given `tangram up` without Flower, when actions run, then the workers publish no Celery
    task events (nobody reads them); when a monitor enables events (`enable_events`, what Flower
    sends every few seconds), then the next actions' tasks show up as events."""
    import threading

    from tangram_celery.transport.app import make_app

    app = make_app(deployment.url)
    seen: list[str] = []

    def capture(stop: threading.Event) -> None:
        with app.connection_for_read() as conn:
            recv = app.events.Receiver(conn, handlers={"*": lambda e: seen.append(e["type"])})
            for _ in recv.itercapture(limit=None, timeout=0.2, wakeup=False):
                if stop.is_set():
                    return

    def tasks_seen_while(run: Any) -> list[str]:
        seen.clear()
        stop = threading.Event()
        t = threading.Thread(target=lambda: _quietly(capture, stop), daemon=True)
        t.start()
        time.sleep(0.5)  # the receiver's queue is bound
        run()
        time.sleep(1.0)  # events are flushed in batches
        stop.set()
        t.join(timeout=5)
        return [x for x in seen if x.startswith("task-")]

    def calls() -> None:
        for i in range(3):
            out = client.submit(ApiAction(trajectory_id=f"ev{i}", api="calc", request={"expr": "1+2"}))
            assert out.result(timeout=30).output == {"value": 3}

    assert tasks_seen_while(calls) == []
    app.control.enable_events()
    assert "task-succeeded" in tasks_seen_while(calls)


def _quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # the receiver's socket timing out at the end
        pass
