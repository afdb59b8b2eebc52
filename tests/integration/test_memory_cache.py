"""CPU memory as a cache, one-shot actions, ready sandboxes and restarts, on real processes.

Each test runs a whole deployment (embedded Redis, scheduler, a CPU worker on the namespace
backend) with a small sandbox memory budget, as a stateless caller would meet it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from tangram_celery import ActionStatus, ApiAction, CodeAction
from tangram_celery.store import RESETS, TRAJ
from tests.fixtures.common import unavailable, wait_until

NAMESPACE = {"backend": "namespace", "default_timeout_s": 10, "prewarm": 2}


@pytest.fixture(autouse=True)
def _needs_namespaces() -> None:
    from tangram_celery.sandbox.namespace import bwrap_path

    if os.geteuid() != 0 or bwrap_path() is None:
        unavailable("the namespace sandbox needs root and bubblewrap")


def pins(deployment: Any) -> dict[str, dict[str, Any]]:
    r = redis.Redis.from_url(deployment.url, decode_responses=True)
    try:
        return {k: json.loads(v) for k, v in r.hgetall(TRAJ).items()}
    finally:
        r.close()


def resets(deployment: Any) -> set[str]:
    r = redis.Redis.from_url(deployment.url, decode_responses=True)
    try:
        return set(r.hkeys(RESETS))
    finally:
        r.close()


def scheduler_log(deployment: Any) -> str:
    return (Path(deployment.state_dir) / "logs" / "scheduler.log").read_text(errors="replace")


@pytest.mark.deploy(nodes={"cpu": [{"name": "n0", "cores": 2, "memory_mb": 1024}]}, sandbox=NAMESPACE)
def test_never_closed_trajectories_do_not_stall(client, deployment) -> None:
    """Given sandbox memory for 4 trajectories of 256 MiB, when 40 trajectories each write a file
    and are never closed, then all 40 complete at once (idle ones are evicted, no TTL wait), the
    scheduler never reports a stall, and a later action says whether its files survived: the
    evicted trajectories' results have sandbox_reset and no file, one still holding its
    sandbox keeps its file."""
    n = 40
    write = [
        CodeAction(trajectory_id=f"s{i}", code=f"open('f', 'w').write('{i}')", memory_mb=256, timeout_s=30)
        for i in range(n)
    ]
    t0 = time.monotonic()
    first = [h.result(timeout=300) for h in client.submit_many(write)]
    took_s = time.monotonic() - t0
    assert [r.status for r in first] == [ActionStatus.OK] * n, [r for r in first if not r.ok][:2]
    assert not any(r.sandbox_reset for r in first)
    held = pins(deployment)
    assert 1 <= len(held) <= 4, held
    # The latest trajectory still holding its sandbox is read first: which of the last few
    # finished last (and so is evicted last) depends on how they shared the cores, and reading
    # s0 first would evict the least recently used of them.
    kept = max(i for i in range(n) if f"s{i}" in held)
    read = "print(open('f').read() if __import__('os').path.exists('f') else 'gone')"
    again = {
        i: client.submit(CodeAction(trajectory_id=f"s{i}", code=read, memory_mb=256)).result(timeout=120)
        for i in (kept, 0)
    }
    assert again[0].sandbox_reset and again[0].stdout.strip() == "gone", again[0]
    assert not again[kept].sandbox_reset and again[kept].stdout.strip() == str(kept), again[kept]
    # evictions are summed up in the log by the scheduler's periodic pass (every second)
    wait_until("the evictions to be logged", lambda: "evicted" in scheduler_log(deployment), timeout_s=10)
    assert "no progress" not in scheduler_log(deployment)
    print(f"40 never-closed trajectories in {took_s:.1f} s")


@pytest.mark.deploy(nodes={"cpu": [{"name": "n0", "cores": 2, "memory_mb": 1024}]}, sandbox=NAMESPACE)
def test_one_shot_actions_hold_nothing_after_they_complete(client, deployment) -> None:
    """Given sandbox memory for two 512 MiB sandboxes, when 12 code actions without a trajectory
    run, then all complete with their output and leave no pin or reservation; an ephemeral
    action of a trajectory sees none of the trajectory's files and leaves none; an API action
    needs no trajectory."""
    handles = client.submit_many(
        [CodeAction(code=f"print({i} * 2)", memory_mb=512, timeout_s=30) for i in range(12)]
    )
    out = [h.result(timeout=300) for h in handles]
    assert [(r.status, r.stdout.strip(), r.trajectory_id) for r in out] == [
        (ActionStatus.OK, str(i * 2), "") for i in range(12)
    ]
    assert pins(deployment) == {}
    mine = CodeAction(trajectory_id="keep", code="open('mine', 'w').write('x')", memory_mb=256)
    assert client.submit(mine).result(timeout=120).ok
    look = (
        "import os; print(sorted(f for f in os.listdir('.') if f != 'main.py')); open('eph', 'w').write('y')"
    )
    eph = client.submit(CodeAction(trajectory_id="keep", ephemeral=True, code=look)).result(timeout=120)
    assert (eph.status, eph.stdout.strip(), eph.trajectory_id) == (ActionStatus.OK, "[]", "keep")
    after = client.submit(CodeAction(trajectory_id="keep", code=look)).result(timeout=120)
    assert after.stdout.strip() == "['mine']"
    assert set(pins(deployment)) == {"keep"}
    calc = client.submit(ApiAction(api="calc", request={"expr": "6*7"})).result(timeout=60)
    assert calc.ok and calc.output is not None and calc.trajectory_id == ""


def sandbox_memory_limits_mb(worker_pid: int) -> set[int]:
    """The memory limits (MiB) of the cgroups the worker's sandbox runners live in."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    todo, seen = [worker_pid], set()
    while todo:
        pid = todo.pop()
        seen.add(pid)
        todo += children.get(pid, [])
    out = set()
    for pid in seen - {worker_pid}:
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            _, ctrls, rel = line.split(":", 2)
            if "memory" in ctrls.split(",") and "tangram" in rel:
                limit = Path("/sys/fs/cgroup/memory") / rel.lstrip("/") / "memory.limit_in_bytes"
                if limit.exists():
                    out.add(int(limit.read_text()) // (1024 * 1024))
            elif ctrls == "" and "tangram" in rel:
                limit = Path("/sys/fs/cgroup") / rel.lstrip("/") / "memory.max"
                if limit.exists():
                    out.add(int(limit.read_text()) // (1024 * 1024))
    return out


@pytest.mark.deploy(
    nodes={"cpu": [{"name": "n0", "cores": 2, "memory_mb": 1024}]}, sandbox={**NAMESPACE, "prewarm": 0}
)
def test_a_larger_memory_ask_is_reserved_before_the_limit_grows(client, deployment) -> None:
    """Given a trajectory that reserved 96 MiB, when its next action asks for 320 MiB, then the
    scheduler's reservation (persisted pin) and the sandbox's cgroup limit are both 320 MiB, and
    the action can use the memory."""
    first = CodeAction(trajectory_id="grow", code="print('a')", memory_mb=96)
    assert client.submit(first).result(timeout=120).ok
    assert pins(deployment)["grow"]["memory_mb"] == 96
    worker = deployment.children["worker-cpu-n0"].proc.pid
    assert sandbox_memory_limits_mb(worker) == {96}
    big = CodeAction(
        trajectory_id="grow", code="b = bytearray(200 << 20); print(len(b) >> 20)", memory_mb=320
    )
    res = client.submit(big).result(timeout=120)
    assert (res.status, res.stdout.strip()) == (ActionStatus.OK, "200"), res
    assert pins(deployment)["grow"]["memory_mb"] == 320
    assert sandbox_memory_limits_mb(worker) == {320}


@pytest.mark.deploy(nodes={"cpu": [{"name": "n0", "cores": 2, "memory_mb": 1024}]}, sandbox=NAMESPACE)
def test_a_restarted_worker_releases_the_sandboxes_it_lost(client, deployment) -> None:
    """Given four idle trajectories holding all sandbox memory, when the CPU worker is killed
    (the supervisor restarts it), then their pins and reservations are released within seconds,
    and each one's next action runs in a fresh sandbox with sandbox_reset."""
    for i in range(4):
        act = CodeAction(trajectory_id=f"r{i}", code="open('f', 'w').write('x')", memory_mb=256)
        assert client.submit(act).result(timeout=120).ok
    assert len(pins(deployment)) == 4
    deployment.kill("worker-cpu-n0")
    wait_until("the lost trajectories to be released", lambda: pins(deployment) == {}, timeout_s=60)
    assert resets(deployment) == {f"r{i}" for i in range(4)}
    read = "import os; print(os.path.exists('f'))"
    res = client.submit(CodeAction(trajectory_id="r0", code=read, memory_mb=256)).result(timeout=120)
    assert (res.status, res.stdout.strip(), res.sandbox_reset) == (ActionStatus.OK, "False", True)
    assert "r0" not in resets(deployment)
    ok = client.submit(CodeAction(trajectory_id="r0", code=read, memory_mb=256)).result(timeout=120)
    assert not ok.sandbox_reset


def test_a_restarted_stack_does_not_start_without_memory(tmp_path: Path) -> None:
    """Given a stack whose four idle trajectories hold all sandbox memory, when the whole stack
    is stopped and started again over the same state directory, then the new scheduler releases
    their reservations (their sandboxes died with the old workers), new trajectories run, and the
    old ones' next actions say sandbox_reset."""
    from tangram_celery import TangramClient
    from tangram_celery.common.config import load_config
    from tangram_celery.deploy import Deployment
    from tests.fixtures.redis import deployment_config

    path = deployment_config(
        tmp_path, nodes={"cpu": [{"name": "n0", "cores": 2, "memory_mb": 1024}]}, sandbox=NAMESPACE
    )
    first = Deployment(load_config(path), path, with_flower=False)
    try:
        first.start(progress=False)
        with TangramClient(first.url) as c:
            for i in range(4):
                act = CodeAction(trajectory_id=f"old{i}", code="print(1)", memory_mb=256)
                assert c.submit(act).result(timeout=120).ok
        assert len(pins(first)) == 4
    finally:
        first.stop()
    second = Deployment(load_config(path), path, with_flower=False)
    try:
        second.start(progress=False)
        wait_until("the restored reservations to be released", lambda: pins(second) == {}, timeout_s=60)
        with TangramClient(second.url) as c:
            new = c.submit(CodeAction(trajectory_id="new", code="print(2)", memory_mb=1024)).result(
                timeout=120
            )
            assert new.ok and not new.sandbox_reset
            old = c.submit(CodeAction(trajectory_id="old1", code="print(3)", memory_mb=256)).result(
                timeout=120
            )
            assert old.ok and old.sandbox_reset
        # released by reconciliation (the new worker reports no sandbox), or earlier: when the
        # old worker's heartbeats run out before the new one's start (a loaded machine), or by
        # the old scheduler when it saw the old worker drain its node as the stack stopped
        log = scheduler_log(second)
        reasons = ("lost their sandbox", "pinned to offline nodes unpinned", "released from draining nodes")
        assert any(r in log for r in reasons), log
    finally:
        second.stop()


# What a hostile occupant tries to leave for the next one in a recycled sandbox: (code, the
# status its action must end with). Under SMALL_LIMITS-like settings (below).
HOSTILE = {
    "fork bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        ActionStatus.PIDS_LIMIT,
    ),
    "memory hog": ("a = []\nwhile True:\n    a.append(bytearray(1 << 20))\n", ActionStatus.MEMORY_LIMIT),
    "disk filler": (
        "i = 0\nwhile True:\n    open(f'/work/f{i}', 'w').write('y' * (1 << 20))\n    i += 1\n",
        ActionStatus.DISK_LIMIT,
    ),
    "daemon": (  # double-forked, it would keep writing files into the next occupant's sandbox
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        for i in range(600):\n            time.sleep(0.05)\n"
        "            for d in ('/work', '/tmp'):\n"
        "                try:\n                    open(f'{d}/daemon{i}', 'w').write('x')\n"
        "                except OSError:\n                    pass\n"
        "    os._exit(0)\nprint('parent done')\n",
        ActionStatus.OK,
    ),
    "planter": (  # files, a directory it locks itself out of, links out, shared memory
        "import os\nfor d in ('/work', '/tmp', '/dev/shm'):\n    try:\n"
        "        os.makedirs(f'{d}/nest/deep', exist_ok=True)\n"
        "        open(f'{d}/nest/deep/secret', 'w').write('s')\n"
        "        os.symlink('/etc', f'{d}/etc_link')\n        os.chmod(f'{d}/nest', 0)\n"
        "    except OSError as e:\n        print(d, e)\n",
        ActionStatus.OK,
    ),
    "spinner": ("while True:\n    pass\n", ActionStatus.TIMEOUT),
}

# Run by a later occupant: "clean" when /work, /tmp and /dev/shm hold nothing but the program
# and no process of the user's uid is alive but itself; else what it found.
PROBE = (
    "import os\nleft = []\nfor d in ('/work', '/tmp', '/dev/shm'):\n    try:\n"
    "        left += [f'{d}/{n}' for n in os.listdir(d) if n != 'main.py']\n"
    "    except FileNotFoundError:\n        pass\n"
    "me, uid = os.getpid(), os.getuid()\nfor p in os.listdir('/proc'):\n"
    "    if p.isdigit() and int(p) != me:\n        try:\n"
    "            st = open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()\n"
    "            if os.stat(f'/proc/{p}').st_uid == uid and st[0] not in 'ZX':\n"
    "                left.append(f'pid {p}')\n        except OSError:\n            pass\n"
    "print('clean' if not left else left)\n"
)


@pytest.mark.deploy(
    nodes={"cpu": [{"name": "n0", "cores": 2, "memory_mb": 1024}]},
    sandbox={**NAMESPACE, "pids_limit": 64, "disk_quota_mb": 16},
)
def test_hostile_stateless_callers_leave_nothing_for_the_next_occupant(client, deployment) -> None:
    """Given sandbox memory for four 256 MiB trajectories (so sandboxes are evicted, scrubbed and
    handed to new trajectories all the time), when 60 never-closed trajectories run, in
    submission order, rounds of: a hostile program (fork bomb, memory hog, disk filler, a daemon
    that keeps writing files, a planter of files, links and locked directories, an endless
    loop), a HumanEval reference with its check, and a probe, and the CPU worker is SIGKILLed
    after the first third has completed, then every action completes (none is lost), each
    hostile one with its limit's status, every reference passes and every probe finds its
    sandbox clean: no file and no user process of an earlier occupant; the scheduler never
    reports a stall."""
    from tests.problems import humaneval_problems

    problems = humaneval_problems()
    acts: list[tuple[CodeAction, Any]] = []  # (action, expected status or "clean")
    for i in range(20):
        name = list(HOSTILE)[i % len(HOSTILE)]
        code, status = HOSTILE[name]
        acts.append((CodeAction(trajectory_id=f"h{i}", code=code, memory_mb=256, timeout_s=3), status))
        p = problems[(7 * i) % len(problems)]
        acts.append(
            (
                CodeAction(
                    trajectory_id=f"p{i}", code=p.reference, test_cases=p.tests, memory_mb=256, timeout_s=30
                ),
                ActionStatus.OK,
            )
        )
        acts.append((CodeAction(trajectory_id=f"c{i}", code=PROBE, memory_mb=256, timeout_s=30), "clean"))
    handles = client.submit_many([a for a, _ in acts])
    results = []
    for k, h in enumerate(handles):
        if k == len(handles) // 3:
            deployment.kill("worker-cpu-n0")  # the supervisor restarts it; its actions run again
        results.append(h.result(timeout=300))
    wrong = []
    for (act, want), res in zip(acts, results, strict=True):
        if want == "clean":
            ok = res.status is ActionStatus.OK and res.stdout.strip() == "clean"
        else:
            ok = res.status is want
        if not ok:
            wrong.append((act.trajectory_id, want, res.status, res.stdout[-300:], res.error[-300:]))
    assert not wrong, wrong
    assert "no progress" not in scheduler_log(deployment)
