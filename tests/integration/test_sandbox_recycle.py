"""Recycled sandboxes (namespace backend): what one occupant leaves is gone for the next."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tangram_celery.common.actions import ActionStatus
from tangram_celery.sandbox import ExecRequest
from tests.fixtures.docker import namespace_sandbox

# The previous occupant: leaves processes, files (hidden, locked, in /tmp and /dev/shm),
# symlinks to the runner's places, a chmod'ed workdir, and tries SysV/POSIX IPC and the runner.
HOSTILE = r"""
import ctypes, os, subprocess
for d in ('/work', '/tmp'):
    os.makedirs(d + '/.hidden/deep', exist_ok=True)
    open(d + '/.hidden/deep/secret', 'w').write('planted')
    open(d + '/expected_output.txt', 'w').write('PASS')
    os.chmod(d + '/.hidden', 0)
for name, target in (('runner', '/opt/tangram/runner'), ('run', '/run/tangram'), ('root', '/')):
    os.symlink(target, '/work/' + name)
    os.symlink(target, '/tmp/' + name)
try:
    open('/dev/shm/planted', 'w').write('x')
except OSError:
    pass
libc = ctypes.CDLL(None, use_errno=True)
print('shmget', libc.shmget(0, 4096, 0o1777), ctypes.get_errno())
print('msgget', libc.msgget(0, 0o1777), ctypes.get_errno())
for sig in (9, 15):
    try:
        os.kill(1, sig)
    except OSError as e:
        print('kill 1', e.errno)
if os.fork() == 0:  # a daemon: double fork, new session
    os.setsid()
    if os.fork() == 0:
        subprocess.Popen(['sleep', '1000'])
        os.execv('/bin/sleep', ['sleep', '1000'])
    os._exit(0)
n = 0
try:
    while n < 400:  # fork bomb leftovers (the pids limit stops it)
        if os.fork() == 0:
            import time; time.sleep(1000); os._exit(0)
        n += 1
except OSError:
    pass
os.chmod('/work', 0)
"""

# The next occupant: what of the previous one can it see?
INSPECT = r"""
import os
def listing(top):
    try:
        return sorted(os.listdir(top))
    except OSError as e:
        return 'error %s' % e.errno
me = {os.getpid(), os.getppid()}
others = []
for p in os.listdir('/proc'):
    if p.isdigit() and int(p) not in me:
        try:
            uid = open('/proc/%s/status' % p).read().split('Uid:')[1].split()[0]
            state = open('/proc/%s/stat' % p).read().rsplit(')', 1)[1].split()[0]
        except OSError:
            continue
        if uid == str(os.getuid()) and state != 'Z':
            others.append(p)
ipc = [open('/proc/sysvipc/' + k).read().splitlines()[1:] for k in ('shm', 'msg', 'sem')]
print(listing('/work'), listing('/tmp'), listing('/dev/shm'), others, ipc, oct(os.stat('/work').st_mode & 0o777))
"""
CLEAN = "['main.py'] [] [] [] [[], [], []] 0o755"


@pytest.fixture(scope="module")
def box() -> Iterator[Any]:
    yield from namespace_sandbox(prewarm=1)


def req(code: str, timeout_s: float = 20) -> ExecRequest:
    return ExecRequest(language="python", code=code, timeout_s=timeout_s, cores=(0,), memory_mb=128)


def test_a_recycled_sandbox_shows_nothing_of_its_previous_occupant(box: Any) -> None:
    """Given a sandbox whose occupant planted files, links, locked dirs, daemons and fork-bomb
    children, tried IPC and signalled the runner, when it is scrubbed, then the next occupant
    sees an empty workdir, /tmp and /dev/shm, no process of its uid, no IPC object, and the
    runner's files (the link targets) are intact."""
    assert box.ready.wait_full(60)
    h = box.ready.take()
    first = box._exec(h, req(HOSTILE))
    assert "shmget -1 1" in first.stdout and "msgget -1 1" in first.stdout, first  # EPERM
    fresh = box._recycle(h)
    assert fresh is not None and fresh.ref is h.ref
    res = box._exec(fresh, req(INSPECT))
    assert (res.status, res.stdout.strip()) == (ActionStatus.OK, CLEAN), res
    again = box._exec(fresh, req("print(open('/opt/tangram/runner/tangram_runner/runner.py').read()[:3])"))
    assert again.stdout.strip() == '"""', again
    box._teardown(fresh)


def test_one_connection_to_the_runner_serves_a_sandbox_across_its_occupants(box: Any) -> None:
    """Given a ready sandbox (its runner answered the start's ping), when one occupant runs two
    actions, the sandbox is scrubbed and the next occupant runs one, then all of these went over
    the one connection the host made for the ping (`RunnerLink`): no connect, accept or close
    per request."""
    assert box.ready.wait_full(60)
    h = box.ready.take()
    assert h.link is not None and h.link.owner is h.ref  # made by the start's ping
    sock = h.link._sock
    conn = os.fstat(sock.fileno()).st_ino
    for code in ("print(1)", "print(2)"):
        assert box._exec(h, req(code)).status is ActionStatus.OK
    fresh = box._recycle(h)
    assert fresh is not None and fresh.link is h.link
    assert box._exec(fresh, req("print(3)")).stdout == "3\n"
    assert fresh.link._sock is sock and os.fstat(sock.fileno()).st_ino == conn
    box._teardown(fresh)
    assert fresh.link is None and sock.fileno() == -1  # closed with the sandbox


def test_a_closed_trajectory_sandbox_is_recycled_for_the_next_one(box: Any) -> None:
    """Given a trajectory that wrote files, when it is closed, then its sandbox returns to the
    ready pool scrubbed, and a new trajectory runs in it with an empty workdir."""
    assert box.ready.wait_full(60)
    before = box.ready.recycled
    a, b = f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"
    assert box.run(a, req("open('left', 'w').write('1')")).status is ActionStatus.OK
    box.close_trajectory(a)
    deadline = time.monotonic() + 30
    while box.ready.recycled == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert box.ready.recycled == before + 1
    for _ in range(len(box.ready)):  # every ready sandbox, the recycled one among them
        t = f"{b}-{uuid.uuid4().hex[:4]}"
        res = box.run(t, req(INSPECT))
        assert (res.status, res.stdout.strip()) == (ActionStatus.OK, CLEAN), res
        box.close_trajectory(t)


def test_a_sandbox_with_a_surviving_user_process_is_destroyed_not_recycled(box: Any) -> None:
    """Given a sandbox in whose cgroup a process of the sandbox uid is alive (one that escaped
    the runner's kill), when the host checks it after the scrub, then it refuses to reuse it."""
    import os
    import subprocess

    from tangram_celery.sandbox.limits import SANDBOX_UID

    assert box.ready.wait_full(60)
    h = box.ready.take()
    assert h.cgroups is not None
    proc = subprocess.Popen(["sleep", "60"], user=SANDBOX_UID)  # stands in for an escapee
    try:
        h.cgroups._write("pids", "cgroup.procs", str(proc.pid))
        assert "sandbox uid" in box._tampered(h)
        assert box._recycle(h) is None
    finally:
        os.kill(proc.pid, 9)
        proc.wait()
        box._teardown(h)


# What user code sees of the harness's verifiers (uid VERIFIER_UID) and of other user processes
PROCS = r"""
import os
def procs(uid, seeds=False):
    out = []
    for p in os.listdir('/proc'):
        if p.isdigit() and int(p) != os.getpid():
            try:
                u = open('/proc/%s/status' % p).read().split('Uid:')[1].split()[0]
                state = open('/proc/%s/stat' % p).read().rsplit(')', 1)[1].split()[0]
                seed = open('/proc/%s/comm' % p).read().strip() == 'tangram-vseed'
            except OSError:
                continue
            if u == str(uid) and state not in ('Z', 'X') and seed == seeds:
                out.append(int(p))
    return sorted(out)
def f():
    return 1
print((procs(os.getuid() + 1), procs(os.getuid()), sorted(os.listdir('/work')), procs(os.getuid() + 1, True)))
"""


def with_test(code: str) -> ExecRequest:
    from tangram_celery.common.actions import TestCase

    r = req(code)
    r.test_cases = [TestCase(name="t", assert_code="assert f() == 1")]
    return r


def seen(res: Any) -> tuple[list[int], list[int], list[str]]:
    """(verifier pids, other user pids, /work listing) as the action's code printed them; the
    verifiers' seed (of the verifiers' uid, named tangram-vseed) is not a verifier."""
    verifiers, users, work, _seeds = seen_all(res)
    return verifiers, users, work


def seen_all(res: Any) -> tuple[list[int], list[int], list[str], list[int]]:
    """`seen`, and the pids of the verifiers' seeds."""
    import ast

    verifiers, users, work, seeds = ast.literal_eval(res.stdout.strip())
    return verifiers, users, work, seeds


def test_a_ready_sandbox_has_a_verifier_waiting_and_keeps_nothing_of_its_warm_up(box: Any) -> None:
    """Given a freshly started ready sandbox, when its first action looks around, then one
    verifier and its seed are already waiting, no other process of the user's uid runs, and the
    workdir holds only the action's own main.py (the warm-up test wrote nothing)."""
    for fresh in namespace_sandbox(prewarm=1):
        assert fresh.ready.wait_full(60)
        h = fresh.ready.take()
        res = fresh._exec(h, req(PROCS))
        verifiers, users, work, seeds = seen_all(res)
        assert (res.status, len(verifiers), users, work) == (ActionStatus.OK, 1, [], ["main.py"]), res
        assert len(seeds) == 1 and seeds != verifiers, res
        fresh._teardown(h)


def test_a_scrub_kills_the_verifiers_of_the_previous_occupant_and_primes_a_new_one(box: Any) -> None:
    """Given an occupant whose assert test was judged by a verifier, when its sandbox is
    scrubbed, then the next occupant finds exactly one verifier waiting, not that one, and its
    own first assert test is judged by the waiting one (no verifier started on its path)."""
    assert box.ready.wait_full(60)
    h = box.ready.take()
    first = box._exec(h, with_test(PROCS))
    assert first.status is ActionStatus.OK and first.tests[0].passed, first
    before, _, _ = seen(first)
    assert len(before) == 1
    fresh = box._recycle(h)
    assert fresh is not None
    look = box._exec(fresh, req(PROCS))
    waiting, users, _ = seen(look)
    assert len(waiting) == 1 and set(waiting).isdisjoint(before) and users == [], look
    judged = box._exec(fresh, with_test(PROCS))
    assert judged.status is ActionStatus.OK and seen(judged)[0] == waiting, judged
    box._teardown(fresh)


def test_a_verifier_that_never_got_a_job_stays_for_the_next_occupant(box: Any) -> None:
    """Given an occupant that ran code but no assert test (its primed verifier never got a job,
    so no user code talked to it), when its sandbox is scrubbed, then the next occupant finds
    that same verifier waiting beside the same seed, and it judges the next occupant's test."""
    assert box.ready.wait_full(60)
    h = box.ready.take()
    first = box._exec(h, req(PROCS))
    assert first.status is ActionStatus.OK, first
    before, _, _, seeds = seen_all(first)
    assert len(before) == 1 and len(seeds) == 1, first
    fresh = box._recycle(h)
    assert fresh is not None
    look = box._exec(fresh, req(PROCS))
    assert seen_all(look)[0] == before and seen_all(look)[3] == seeds, look
    judged = box._exec(fresh, with_test(PROCS))
    assert judged.status is ActionStatus.OK and seen(judged)[0] == before, judged
    box._teardown(fresh)


def in_group(r: ExecRequest, group: str) -> ExecRequest:
    r.verifier_group = group
    return r


def test_a_verifier_of_a_group_judges_later_occupants_of_that_group_only(box: Any) -> None:
    """Given an occupant whose assert test a verifier judged for the group `job:a` (what a
    worker names with `sandbox.verifier_scope: job`), when its sandbox is scrubbed, then that
    verifier alone waits and judges the next `job:a` occupant's test (none is forked for it);
    the test of a `job:b` occupant after the next scrub gets a new verifier and the `job:a` one
    is gone; and so does an occupant of no group after that, whose verifier the next scrub
    kills as without groups."""
    assert box.ready.wait_full(60)
    h = box.ready.take()
    first = box._exec(h, in_group(with_test(PROCS), "job:a"))
    assert first.status is ActionStatus.OK and first.tests[0].passed, first
    a, _, _ = seen(first)
    assert len(a) == 1, first

    def next_occupant(h: Any) -> Any:
        fresh = box._recycle(h)
        assert fresh is not None
        return fresh

    h = next_occupant(h)
    same = box._exec(h, in_group(with_test(PROCS), "job:a"))
    assert same.status is ActionStatus.OK and same.tests[0].passed, same
    assert seen(same)[:2] == (a, []), same  # the job:a verifier, nothing else, judged it

    h = next_occupant(h)
    other = box._exec(h, in_group(with_test("def f():\n    return 1"), "job:b"))
    assert other.status is ActionStatus.OK and other.tests[0].passed, other
    b, users, _ = seen(box._exec(h, in_group(req(PROCS), "job:b")))
    assert len(b) == 1 and b != a and users == [], b  # a new one judged job:b; job:a's is gone

    h = next_occupant(h)
    own = box._exec(h, with_test("def f():\n    return 1"))
    assert own.status is ActionStatus.OK and own.tests[0].passed, own
    c, _, _ = seen(box._exec(h, req(PROCS)))
    assert len(c) == 1 and c != b, c

    h = next_occupant(h)
    d, _, _ = seen(box._exec(h, req(PROCS)))
    assert len(d) == 1 and d != c, d  # the occupant's own verifier was killed, a new one primed
    box._teardown(h)


def test_a_verifier_a_test_left_large_retires_after_that_test(box: Any) -> None:
    """Given a verifier of a group whose test left 72 MiB allocated in it (a module of the
    test's own; `verifier.MAX_RSS_MB` is 64), when that test is done, then its verdict
    stands, the verifier has ended, and the next test gets a new one, which stays."""
    from tangram_celery.common.actions import TestCase

    def grouped(code: str, test: str | None = None) -> ExecRequest:
        r = in_group(req(code), "job:a")
        r.memory_mb = 512  # the sandbox's memory holds the verifier's 72 MiB
        if test is not None:
            r.test_cases = [TestCase(name="t", assert_code=test)]
        return r

    assert box.ready.wait_full(60)
    h = box.ready.take()
    keep = "import sys\nsys.modules['_kept_by_a_test'] = b'x' * (72 << 20)\nassert f() == 1"
    large = box._exec(h, grouped(PROCS, keep))
    assert large.status is ActionStatus.OK and large.tests[0].passed, large
    (first,) = seen(large)[0]
    after = box._exec(h, grouped(PROCS, "assert f() == 1"))
    assert after.status is ActionStatus.OK and after.tests[0].passed, after
    again = box._exec(h, grouped(PROCS, "assert f() == 1"))
    assert again.status is ActionStatus.OK and again.tests[0].passed, again
    (second,) = seen(again)[0]
    assert second != first and seen(after)[0] in ([], [second]), (after, again)
    box._teardown(h)


def test_a_recycled_sandbox_keeps_its_binding_and_is_handed_out_without_a_cgroup_write(box: Any) -> None:
    """Given a sandbox that ran an action on core 1 with 128 MiB, when it is scrubbed, then it
    stays bound to core 1 and 128 MiB, and the next action on core 1 writes no cgroup file."""
    assert box.ready.wait_full(60)
    h = box.ready.take()
    on1 = req("print(1)")
    on1.cores = (1,)
    assert box._exec(h, on1).status is ActionStatus.OK
    fresh = box._recycle(h)
    assert fresh is not None and (fresh.cores, fresh.memory_mb) == ((1,), 128)
    assert fresh.cgroups._read("cpuset", "cpuset.cpus").strip() == "1"

    def no_write(*args: Any) -> None:
        raise AssertionError("a cgroup file was written")

    fresh.cgroups._write = no_write
    try:
        res = box._exec(fresh, on1)
    finally:
        del fresh.cgroups._write
    assert (res.status, res.stdout.strip()) == (ActionStatus.OK, "1"), res
    box._teardown(fresh)


def test_a_primed_verifier_warms_up_only_on_an_idle_worker_with_a_full_pool(box: Any) -> None:
    """Given a worker's ready pool, when a scrub asks for a verifier, then the verifier warms
    itself up while the pool holds `prewarm` sandboxes and no action runs on the worker, and
    not while the pool is short (new trajectories then arrive faster than it refills) nor while
    an action runs (a warm-up costs more CPU than it saves: the cores go to actions)."""
    import threading

    assert box.ready.wait_full(60)
    full = box._prime()["prime"]["warm_verifier"]
    h = box.ready.take()
    try:
        short = box._prime()["prime"]["warm_verifier"]
    finally:
        box.ready.give_back(h)
    assert box.ready.wait_full(60)
    slow = threading.Thread(target=box.run, args=(f"slow-{os.getpid()}", req("import time; time.sleep(3)")))
    slow.start()
    try:
        deadline = time.monotonic() + 10
        while box._running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        busy = box._prime()["prime"]["warm_verifier"]
    finally:
        slow.join()
    assert (full, short, busy) == (True, False, False)
